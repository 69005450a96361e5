"""What the policy remembers about each incident (bounded: the newest few).

Fusion groups steps into incidents (``decision.incident_id``); the policy never
regroups them. A hand-made decision without one is an incident of its own,
with a deterministic id from its onset (or its step).
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
    lr_induced: bool = False  # its LR jump was scaled back: the loss alone rolls nothing back
    watched: bool = False  # the one ALERT saying a recovery was not warranted was sent

    def in_grace(self, tick: int, grace: int) -> bool:
        return self.last_recovery_tick is not None and tick - self.last_recovery_tick < grace


@dataclass
class PendingSpike:
    """A spike (or a finite extreme loss) waiting out its patience before it is judged."""

    incident: str
    onset: int
    start: int  # the spike's own step
    judge_at: int  # the step whose decision judges it
    critical: bool
    harmless: bool  # every update of it so far left the weights about as they were
    # an update of it went beyond absorbed_grad_ratio of its baseline gradient (evidence, known)
    unbounded: bool = False
    losses: list[float] = field(default_factory=list)  # its anomalous decisions' finite losses
    # What a later rollback claims (the spike's own step, not the judging one) and the evidence
    # for it, as JSON: the trainer checks them against what it saw at that step.
    claim: dict[str, Any] | None = None
    evidence: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "PendingSpike":
        # (kept from before "harmless": it was "grad_bounded"; from before claims: none)
        return cls(
            incident=state["incident"],
            onset=state["onset"],
            start=state["start"],
            judge_at=state["judge_at"],
            critical=bool(state.get("critical")),
            harmless=bool(state.get("harmless", state.get("grad_bounded"))),
            unbounded=bool(state.get("unbounded", True)),  # from before: as it was, rolled back
            losses=[float(x) for x in state.get("losses", ())],
            claim=state.get("claim"),
            evidence=state.get("evidence"),
        )


class IncidentBook:
    def __init__(self, run_id: str, capacity: int) -> None:
        self.run_id, self.capacity = run_id, capacity
        self.incidents: OrderedDict[str, Incident] = OrderedDict()

    def key_of(self, decision: Decision) -> str:
        if decision.incident_id:
            return decision.incident_id
        onset = (
            decision.step if decision.incident_onset_step is None else decision.incident_onset_step
        )
        return incident_id(self.run_id, onset, decision.epoch)

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

    def state_dict(self) -> dict[str, Any]:
        return {"incidents": [asdict(i) for i in self.incidents.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.incidents = OrderedDict((i["key"], Incident(**i)) for i in state["incidents"])
