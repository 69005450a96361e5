"""An ordered list of actions for one cause, with deterministic ids.

Ids derive from the cause (a decision id, or the action an ack answers), the
rollback epoch, the kind and the position among siblings: replaying the same
input gives the same ids, and a re-run after a rollback (same decision ids,
next epoch) gives different ones.
"""

from __future__ import annotations

from typing import Any

from spikeguard.schemas import Action, ActionKind, action_id


class ActionPlan:
    def __init__(
        self,
        run_id: str,
        cause: str,
        epoch: int,
        apply_at_step: int,
        decision_id: str | None = None,
        incident_id: str | None = None,
    ) -> None:
        self.run_id, self.cause, self.epoch = run_id, cause, epoch
        self.apply_at_step = apply_at_step
        self.decision_id, self.incident_id = decision_id, incident_id
        self.items: list[tuple[ActionKind, dict[str, Any], str]] = []

    def add(self, kind: ActionKind, params: dict[str, Any], reason: str) -> str:
        """Append an action; returns the id it will carry."""
        self.items.append((kind, params, reason))
        return action_id(self.source, kind.value, len(self.items) - 1)

    @property
    def source(self) -> str:
        return f"{self.cause}@{self.epoch}"

    def alert(self, severity: str, message: str, reason: str | None = None) -> str:
        """An ALERT (severity ``info``, ``warning`` or ``critical``) for the people watching."""
        params = {"severity": severity, "message": message}
        return self.add(ActionKind.ALERT, params, reason or message)

    def actions(self) -> list[Action]:
        return [
            Action(
                action_id=action_id(self.source, kind.value, ordinal),
                run_id=self.run_id,
                kind=kind,
                apply_at_step=self.apply_at_step,
                params=params,
                decision_id=self.decision_id,
                incident_id=self.incident_id,
                reason=reason,
            )
            for ordinal, (kind, params, reason) in enumerate(self.items)
        ]
