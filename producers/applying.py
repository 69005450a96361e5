"""How the Guard takes in actions: received and checked, applied at their step, acknowledged.

:class:`ActionApplier` is owned by the Guard (``guard.applier``) and handed what
it works with when it is built: the run's state, the inbox, the action queue and
ledger, the checkpoint keeper (an incident's checkpoints and forensics), the
rank sync, and the run's :class:`~spikeguard.producers.steering.Steering` (what
moves the run, within its mode and recovery budget), which it owns. Every ack
goes through :class:`Acknowledgements`.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from spikeguard.producers.actions import ActionQueue, Outcome, marks_trouble
from spikeguard.producers.checkpointing import CheckpointKeeper
from spikeguard.producers.distributed import RankSync, failures
from spikeguard.producers.health import HealthTracker
from spikeguard.producers.inbox import ActionInbox
from spikeguard.producers.ledger import ActionLedger
from spikeguard.producers.lockstep import DecisionWaiter
from spikeguard.producers.narration import STEERING
from spikeguard.producers.run_events import RunEvents
from spikeguard.producers.run_state import RunState
from spikeguard.producers.steering import Steering
from spikeguard.schemas import AckStatus, Action, ActionKind


class Acknowledgements:
    """Every action's one ack: kept in ``applied`` (newest last), counted, and published."""

    def __init__(self, run: RunState, events: RunEvents, keep: int = 1000) -> None:
        self.run = run
        self.events = events
        self.applied: deque[dict[str, Any]] = deque(maxlen=keep)
        self.notices: Counter[str] = Counter()  # alerts and checkpoints applied, by kind

    def send(self, outcome: Outcome) -> None:
        a, counters = outcome.action, self.run.counters
        self.applied.append(
            {
                "step": outcome.step,
                "epoch": self.run.generation,
                "kind": a.kind.value,
                "status": outcome.status.value,
                "result": outcome.result,
                "action_id": a.action_id,
            }
        )
        if outcome.status is AckStatus.APPLIED:  # counted as the summary counts them
            if a.kind in STEERING:
                counters["actions_applied"] += 1
            else:
                counters["notices_applied"] += 1
                self.notices[a.kind.value] += 1
        counters["acks"] += 1
        self.events.ack(outcome)


class ActionApplier:
    """Takes actions in from the inbox, applies the due ones at their step, acks each once."""

    def __init__(
        self,
        run: RunState,
        *,
        actions: ActionQueue,
        ledger: ActionLedger,
        inbox: ActionInbox | None,
        waiter: DecisionWaiter | None,
        sync: RankSync,
        health: HealthTracker,
        checkpoints: CheckpointKeeper,
        acks: Acknowledgements,
        steering: Steering,
    ) -> None:
        self.run = run
        self.actions = actions
        self.ledger = ledger
        self.inbox = inbox
        self.waiter = waiter
        self.sync = sync
        self.rank = sync.rank
        self.health = health
        self.checkpoints = checkpoints
        self.acks = acks
        self.steering = steering
        self.resolved = 0  # actions answered since the ledger was last written

    def collect(self, step: int) -> None:
        """Take in what the inbox received: refused and duplicate actions are acked at once."""
        if self.inbox is None:
            return
        if self.waiter is not None:
            self.inbox.poll_now(0.0)
        for action in self.inbox.take():
            outcome = self.actions.receive(action, step)
            if outcome is not None:
                self.acks.send(outcome)
                self.inbox.resolved(1)

    def apply(self, due: list[Action], step: int) -> bool:
        """Apply the actions due at ``step``; True when a rollback or stop ended the step."""
        interrupted = False
        self.steering.weigh_plans(due)  # (the recovery budget: each decision's plan, whole)
        for action in due:
            broken = self.actions.broken_plan(action)
            if (
                broken is not None
                and action.kind in STEERING
                and self.steering.withhold_reason(action) is not None
            ):
                broken = None  # withheld anyway (mode, budget): said and acked as withheld, as the rest was
            duplicate = self.rank == 0 and action.action_id in self.ledger
            if self.sync.enabled:  # rank 0's ledger decides for every rank
                duplicate = self.sync.share(duplicate)
            if duplicate:
                outcome: Outcome | None = Outcome(
                    action, AckStatus.DUPLICATE, self.run.step_count, "already applied"
                )
            elif broken is not None:  # its plan's rollback failed: the rest must not run without it
                outcome = Outcome(action, AckStatus.FAILED, self.run.step_count, broken)
                self.ledger.record(action.action_id)
            else:
                if marks_trouble(action) or action.kind is ActionKind.ALERT:  # (an outlier's)
                    # before a rollback moves the data and the store
                    self.checkpoints.keep_incident(action)
                outcome = self.steering.apply_one(action)  # (mode, budget, said out loud)
                self.ledger.record(action.action_id)
                if self.sync.enabled:
                    outcome = self._same_on_every_rank(action, outcome)
                if outcome is not None and outcome.status is not AckStatus.APPLIED:
                    self.actions.plan_failed(action, outcome)
            applied = outcome is None or outcome.status is AckStatus.APPLIED
            if applied and marks_trouble(action):
                self.health.on_anomaly()
                self.checkpoints.incident_found(action)
            if applied and action.kind in (ActionKind.ROLLBACK, ActionKind.STOP):
                interrupted = True
            if outcome is not None:
                self.acks.send(outcome)
            self.resolved += 1
        return interrupted

    def _same_on_every_rank(self, action: Action, outcome: Outcome | None) -> Outcome | None:
        """Every rank applied ``action`` (the same broadcast list, at the same step), or none did.

        When some ranks applied it and others failed, their states differ: every rank stops,
        with the same message, and the action is acked FAILED with it (a rollback agrees
        within itself, checkpointing.py, so it never gets here split).
        """
        failed = (
            outcome.result if outcome is not None and outcome.status is AckStatus.FAILED else None
        )
        errors = self.sync.outcomes(failed)
        if all(e is None for e in errors) or all(e is not None for e in errors):
            return outcome
        message = (
            f"ranks disagree on {action.kind.value} {action.action_id}: "
            f"{failures(errors)}; the run stops"
        )
        self.run.request_stop(message)
        return Outcome(action, AckStatus.FAILED, self.run.step_count, message)

    def finish(self) -> None:
        """At the end of a step: the answered actions go into the ledger file, then the inbox may
        commit past them."""
        if self.resolved:
            self.checkpoints.persist_ledger()
            if self.inbox is not None:
                self.inbox.resolved(self.resolved)
            self.resolved = 0
