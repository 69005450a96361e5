"""An ordered list of actions for one cause, with deterministic ids.

Ids derive from the cause (a decision id, or the action an ack answers), the
rollback epoch, the kind and the position among siblings: replaying the same
input gives the same ids, and a re-run after a rollback (same decision ids,
next epoch) gives different ones.
"""

from __future__ import annotations

from spikeguard.actuators.responses import Response, tagged
from spikeguard.schemas import Action, Claim, Evidence, action_id
from spikeguard.schemas.actions import ActionParams, AlertParams


class ActionPlan:
    def __init__(
        self,
        run_id: str,
        cause: str,
        epoch: int,
        apply_at_step: int,
        *,
        decision_id: str | None = None,
        incident_id: str | None = None,
        evidence: Evidence | None = None,
        claim: Claim | None = None,
        incident_onset_step: int | None = None,
    ) -> None:
        self.run_id, self.cause, self.epoch = run_id, cause, epoch
        self.apply_at_step = apply_at_step
        self.decision_id, self.incident_id, self.evidence = decision_id, incident_id, evidence
        self.claim = claim  # the decided step and type, which the trainer checks against its own
        self.incident_onset_step = incident_onset_step
        self.items: list[tuple[ActionParams, str]] = []
        # The response the policy chose; every reason added from now on starts with it.
        self.response: Response | None = None

    def add(self, params: ActionParams, reason: str) -> str:
        """Append the action ``params`` describe (their kind is the action's); returns its id."""
        if self.response is not None:
            reason = tagged(self.response, reason)
        self.items.append((params, reason))
        return action_id(self.source, params.kind.value, len(self.items) - 1)

    @property
    def source(self) -> str:
        return f"{self.cause}@{self.epoch}"

    def alert(self, severity: str, message: str, reason: str | None = None) -> str:
        """An ALERT (severity ``info``, ``warning`` or ``critical``) for the people watching."""
        return self.add(AlertParams(severity=severity, message=message), reason or message)

    def actions(self) -> list[Action]:
        return [
            Action(
                action_id=action_id(self.source, params.kind.value, ordinal),
                run_id=self.run_id,
                kind=params.kind,
                apply_at_step=self.apply_at_step,
                params=params,
                decision_id=self.decision_id,
                incident_id=self.incident_id,
                incident_onset_step=self.incident_onset_step,
                evidence=self.evidence,
                claim=self.claim,
                reason=reason,
            )
            for ordinal, (params, reason) in enumerate(self.items)
        ]
