"""When recovering is not working: stop the run rather than loop on rollbacks.

Two rules, both settings: an incident gets ``max_rollbacks_per_incident``
recoveries (a rollback, or the LR-and-skip fallback when no checkpoint was
eligible); and at most ``max_rollbacks_in_window`` rollbacks fall within
``rollback_window_steps`` observed steps. A critical decision needing one
more escalates: an emergency (final) checkpoint, STOP, and a critical ALERT;
after that the policy emits nothing more for the run. A non-critical one is
said once and watched (the policy's business): a chain of low-confidence
incidents never stops a run.
"""

from __future__ import annotations

from typing import Any

from spikeguard.actuators.config import PolicyConfig
from spikeguard.actuators.incidents import Incident
from spikeguard.actuators.action_plan import ActionPlan
from spikeguard.schemas.actions import AlertParams, CheckpointParams, StopParams


class RollbackWindow:
    """The observed-step ticks of recent rollbacks (bounded by the window's allowance)."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.ticks: list[int] = []

    def record(self, tick: int) -> None:
        self.ticks.append(tick)
        del self.ticks[: max(0, len(self.ticks) - self.config.max_rollbacks_in_window)]

    def forget(self, tick: int | None) -> None:
        """A rollback issued at ``tick`` did not happen: it leaves the window."""
        if tick in self.ticks:
            self.ticks.remove(tick)

    def in_window(self, tick: int) -> int:
        return sum(1 for t in self.ticks if tick - t < self.config.rollback_window_steps)

    def escalation_reason(self, incident: Incident, tick: int) -> str | None:
        """Why recovering once more is not allowed, or None when it is."""
        cfg = self.config
        if incident.recoveries >= cfg.max_rollbacks_per_incident:
            return (
                f"incident {incident.key} (onset step {incident.onset_step}) needs recovery "
                f"#{incident.recoveries + 1}; at most {cfg.max_rollbacks_per_incident} allowed"
            )
        recent = self.in_window(tick)
        if recent >= cfg.max_rollbacks_in_window:
            return (
                f"{recent} rollbacks within the last {cfg.rollback_window_steps} steps; "
                f"at most {cfg.max_rollbacks_in_window} allowed"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"ticks": list(self.ticks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ticks = [int(t) for t in state["ticks"]]


def add_escalation(plan: ActionPlan, why: str) -> None:
    """Final checkpoint, stop, critical alert — in that order."""
    message = f"stopping the run: {why}"
    plan.add(CheckpointParams(reason="emergency"), f"final checkpoint before stop: {why}")
    plan.add(StopParams(reason=message), message)
    plan.add(AlertParams(severity="critical", message=message), message)
