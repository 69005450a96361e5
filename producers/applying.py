"""How the Guard takes in actions: received and checked, applied at their step, acknowledged.

A mixin of :class:`~spikeguard.producers.guard.Guard` (it uses the Guard's
inbox, queue, ledger and events); kept apart so that the Guard's step reads
as the training step it is.
"""

from __future__ import annotations

from spikeguard.producers.actions import ANOMALY_KINDS, Outcome
from spikeguard.producers.distributed import failures
from spikeguard.producers.narration import STEERING
from spikeguard.schemas import AckStatus, Action, ActionKind


class ActionApplying:
    def _collect(self, step: int) -> None:
        if self.inbox is None:
            return
        if self.waiter is not None:
            self.inbox.poll_now(0.0)
        for action in self.inbox.take():
            outcome = self.actions.receive(action, step)
            if outcome is not None:
                self._ack(outcome)
                self.inbox.resolved(1)

    def _apply(self, due: list[Action], step: int) -> bool:
        interrupted = False
        self._weigh_plans(due)  # (the Guard's recovery budget: each decision's plan, whole)
        for action in due:
            broken = self.actions.broken_plan(action)
            if broken is not None and action.kind in STEERING and self._withhold_reason(action) is not None:
                broken = None  # withheld anyway (mode, budget): said and acked as withheld, as the rest was
            duplicate = self.rank == 0 and action.action_id in self.ledger
            if self.sync.enabled:  # rank 0's ledger decides for every rank
                duplicate = self.sync.share(duplicate)
            if duplicate:
                outcome: Outcome | None = Outcome(action, AckStatus.DUPLICATE, self.step_count, "already applied")
            elif broken is not None:  # its plan's rollback failed: the rest must not run without it
                outcome = Outcome(action, AckStatus.FAILED, self.step_count, broken)
                self.ledger.record(action.action_id)
            else:
                if action.kind in ANOMALY_KINDS or action.kind is ActionKind.ALERT:  # (an outlier's)
                    self._keep_incident(action)  # before a rollback moves the data and the store
                outcome = self._apply_one(action)  # (the Guard's: mode, budget, said out loud)
                self.ledger.record(action.action_id)
                if self.sync.enabled:
                    outcome = self._same_on_every_rank(action, outcome)
                if outcome is not None and outcome.status is not AckStatus.APPLIED:
                    self.actions.plan_failed(action, outcome)
            applied = outcome is None or outcome.status is AckStatus.APPLIED
            if applied and action.kind in ANOMALY_KINDS:
                self.health.on_anomaly()
                self._incident_found(action)
            if applied and action.kind in (ActionKind.ROLLBACK, ActionKind.STOP):
                interrupted = True
            if outcome is not None:
                self._ack(outcome)
            self._resolved += 1
        return interrupted

    def _same_on_every_rank(self, action: Action, outcome: Outcome | None) -> Outcome | None:
        """Every rank applied ``action`` (the same broadcast list, at the same step), or none did.

        When some ranks applied it and others failed, their states differ: every rank stops,
        with the same message, and the action is acked FAILED with it (a rollback agrees
        within itself, checkpointing.py, so it never gets here split).
        """
        failed = outcome is not None and outcome.status is AckStatus.FAILED
        errors = self.sync.outcomes(outcome.result if failed else None)
        if all(e is None for e in errors) or all(e is not None for e in errors):
            return outcome
        message = (f"ranks disagree on {action.kind.value} {action.action_id}: "
                   f"{failures(errors)}; the run stops")
        self.request_stop(message)
        return Outcome(action, AckStatus.FAILED, self.step_count, message)

    def _finish_actions(self) -> None:
        if self._resolved:
            self._persist_ledger()
            if self.inbox is not None:
                self.inbox.resolved(self._resolved)
            self._resolved = 0

    def _ack(self, outcome: Outcome) -> None:
        a = outcome.action
        self.applied.append({"step": outcome.step, "epoch": self.generation, "kind": a.kind.value,
                             "status": outcome.status.value, "result": outcome.result,
                             "action_id": a.action_id})
        if outcome.status is AckStatus.APPLIED:
            self.counters["actions_applied"] += 1
        self.counters["acks"] += 1
        self.events.ack(outcome)
