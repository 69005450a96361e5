"""What the policy remembers about each incident (bounded: the newest few).

An incident is fusion's (``decision.incident_id``); a decision without one is
grouped with the previous anomaly when it came within ``gap`` steps, else it
opens an incident of its own, with a deterministic id from its onset step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from spikeguard.schemas import Decision, incident_id


@dataclass
class Incident:
    key: str
    onset_step: int
    first_tick: int
    types: list[str] = field(default_factory=list)  # anomaly types seen, in order of appearance
    recoveries: int = 0  # rollbacks, or fallbacks when no checkpoint was eligible
    last_recovery_tick: int | None = None
    explosion_handled: bool = False  # LR lowered and clipping enabled for a gradient explosion
    loss_seen: bool = False  # a loss anomaly was seen in this incident
    divergence_lr_steps: int = 0
    last_divergence_tick: int | None = None
    noticed: bool = False  # the one ALERT of a 'notice' type was sent

    def in_grace(self, tick: int, grace: int) -> bool:
        return self.last_recovery_tick is not None and tick - self.last_recovery_tick < grace


class IncidentBook:
    def __init__(self, run_id: str, capacity: int, gap_steps: int) -> None:
        self.run_id, self.capacity, self.gap_steps = run_id, capacity, gap_steps
        self.incidents: OrderedDict[str, Incident] = OrderedDict()
        # Decisions without incident_id: the open self-made incident and its last anomaly.
        self.own_key: str | None = None
        self.own_last_step: int | None = None

    def key_of(self, decision: Decision) -> str:
        if decision.incident_id:
            return decision.incident_id
        if decision.incident_onset_step is not None:
            return incident_id(self.run_id, decision.incident_onset_step)
        close = (
            self.own_key is not None
            and self.own_last_step is not None
            and 0 <= decision.step - self.own_last_step <= self.gap_steps
        )
        if not close:
            self.own_key = incident_id(self.run_id, decision.step)
        self.own_last_step = decision.step
        assert self.own_key is not None
        return self.own_key

    def get(self, decision: Decision, tick: int) -> Incident:
        """The incident of an anomalous decision, opened on its first decision."""
        key = self.key_of(decision)
        incident = self.incidents.get(key)
        if incident is None:
            onset = decision.incident_onset_step
            onset = decision.step if onset is None else min(onset, decision.step)
            incident = self.incidents[key] = Incident(key=key, onset_step=onset, first_tick=tick)
            while len(self.incidents) > self.capacity:
                self.incidents.popitem(last=False)
        else:
            self.incidents.move_to_end(key)
        if decision.type.value not in incident.types:
            incident.types.append(decision.type.value)
        return incident

    def rewind(self) -> None:
        """A rollback: the self-made grouping of the abandoned timeline does not carry over."""
        self.own_key = self.own_last_step = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "incidents": [asdict(i) for i in self.incidents.values()],
            "own_key": self.own_key,
            "own_last_step": self.own_last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.incidents = OrderedDict((i["key"], Incident(**i)) for i in state["incidents"])
        self.own_key, self.own_last_step = state["own_key"], state["own_last_step"]
