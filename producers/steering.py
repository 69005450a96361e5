"""Steering the run: everything that changes it, and what lets a change through.

:class:`Steering` is the one object that moves the run (LR, clipping,
rollback, skip windows, stop) and the one that decides whether a steering
action may: the Guard's mode (config.GuardMode) and its recovery budget
(budget.py), weighed per decision, whole, before any of its actions is applied.
Every change it makes, and every one it withholds, is said out loud
(narration.py). The action applier owns it (applying.py); actions reach it
through :func:`~spikeguard.producers.actions.apply_action`, for which it is the
:class:`~spikeguard.producers.actions.Steerable`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable

from spikeguard.producers.actions import (
    ActionFailed,
    ActionQueue,
    Handler,
    Outcome,
    apply_action,
)
from spikeguard.producers.budget import RecoveryBudget, Spend
from spikeguard.producers.checkpointing import CheckpointKeeper
from spikeguard.producers.clipping import GradClipper
from spikeguard.producers.config import GuardMode
from spikeguard.producers.data import GuardedLoader
from spikeguard.producers.distributed import RanksFailed
from spikeguard.producers.ledger import ActionLedger
from spikeguard.producers.lr import LRControl
from spikeguard.producers.narration import STEERING, Cost, Narrator, would_do
from spikeguard.producers.parts import DataPosition
from spikeguard.producers.run_state import RunState
from spikeguard.schemas import WITHHELD, AckStatus, Action, ActionKind
from spikeguard.schemas.actions import RollbackParams, SkipBatchesParams

log = logging.getLogger("spikeguard.producers.guard")

MAX_REFUSED = 1000  # decisions remembered as refused by the budget (oldest forgotten first)


class Steering:
    """Moves the run as actions say, within the mode and the recovery budget."""

    def __init__(
        self,
        run: RunState,
        *,
        mode: GuardMode,
        budget: RecoveryBudget,
        narrator: Narrator,
        lr: LRControl,
        clipper: GradClipper,
        optimizer: Any,
        actions: ActionQueue,
        ledger: ActionLedger,
        checkpoints: CheckpointKeeper,
        position: DataPosition,
    ) -> None:
        self.run = run
        self.mode = mode
        self.budget = budget
        self.narrator = narrator
        self.lr = lr
        self.clipper = clipper
        self.optimizer = (
            optimizer  # a torch optimizer, or a framework's wrapper (set_optimizer_eps)
        )
        self.actions = actions
        self.ledger = ledger
        self.checkpoints = checkpoints
        self.position = position
        self.sync = checkpoints.sync
        self.handlers: dict[ActionKind, Handler] = {}
        self.rollback_listeners: list[Callable[[int, int], None]] = []
        self.refused: OrderedDict[str, str] = OrderedDict()  # decision -> why not applied

    # -- what lets an action through ------------------------------------------------
    def apply_one(self, action: Action) -> Outcome | None:
        """Apply one due action, or withhold it (mode, recovery budget), saying which out loud."""
        step = self.run.step_count
        if action.kind not in STEERING:
            return apply_action(self, action, step)
        because = self.withhold_reason(action)
        if because is not None:
            self.run.counters.actions_withheld += 1
            self.narrator.withhold(action, would_do(action), because, step)
            return Outcome(action, AckStatus.REJECTED, step, f"{WITHHELD}{because}")
        before = self.cost()
        outcome = apply_action(self, action, step)
        if outcome is not None and outcome.status is AckStatus.APPLIED:
            self.narrator.took(action, outcome.result, before, self.cost())
        return outcome

    def withhold_reason(self, action: Action) -> str | None:
        """Why a steering action is withheld (None: it may apply)."""
        if self.mode is GuardMode.OBSERVE:
            return "observe mode"
        if self.mode is GuardMode.SKIP_ONLY:
            return "skip-only mode (only the Guard's own update skips are taken)"
        if action.kind is ActionKind.STOP and action.decision_id is not None and self.refused:
            # Past the budget the Guard alerts and asks: ending the run is a person's call then
            # (an operator's `spikeguard stop` has no decision and still applies).
            return "the recovery budget is spent: stopping the run is left to a person (spikeguard stop)"
        if action.kind is ActionKind.SKIP_BATCHES and self.position.loader is None:
            return (
                "there is no guard.data(loader), so the Guard cannot skip batches; the loop reads "
                "on, and the batches of those steps are not read again"
            )
        # weighed whole, by decision (an action of no decision alone): weigh_plans
        return self.refused.get(action.decision_id or action.action_id)

    def weigh_plans(self, due: list[Action]) -> None:
        """Weigh each decision's plan whole against the recovery budget before any of it is applied:
        a rollback must not go ahead when the skip window that comes with it is refused.

        With several ranks, rank 0 weighs (it alone holds the plans' actions not due yet) with
        the run's length all ranks agree on, and every rank withholds what it refused; when
        weighing fails there, every rank withholds the plans due."""
        if self.mode is not GuardMode.PROTECT:
            return
        plans = dict.fromkeys(
            a.decision_id or a.action_id
            for a in due
            if a.decision_id is not None or a.kind in STEERING
        )
        planned = self.sync.least(self.planned_steps())
        try:
            refused = self.sync.decide(lambda: self._refusals(list(plans), due, planned))
        except RanksFailed as exc:
            refused = {p: f"the recovery budget could not be weighed: {exc}" for p in plans}
        self.refused.update(refused)
        while len(self.refused) > MAX_REFUSED:
            self.refused.popitem(last=False)

    def _refusals(self, plans: list[str], due: list[Action], planned: int) -> dict[str, str]:
        """Why each of ``plans`` (a decision id, or an action id) is refused; those that fit: absent."""
        refused = {}
        for key in plans:
            if key in self.refused:
                continue
            plan = [
                a for a in (*due, *self.actions.pending) if (a.decision_id or a.action_id) == key
            ]
            because = self._over_budget(plan, planned)
            if because is not None:
                refused[key] = f"its plan is {because}"
        return refused

    def _over_budget(self, plan: list[Action], planned: int) -> str | None:
        asked = [
            self._asked(a) for a in plan if a.kind in STEERING and a.action_id not in self.ledger
        ]
        total = Spend(sum(s.rerun_steps for s in asked), sum(s.skip_steps for s in asked))
        spent = Spend(self.narrator.rerun_steps, self.run.counters.skipped_steps)
        return self.budget.refusal(total, spent, planned)

    def _asked(self, action: Action) -> Spend:
        """What a rollback or skip window would cost, in steps, before it is applied."""
        p = action.params
        if isinstance(p, RollbackParams):
            info = self.checkpoints.store.newest_healthy(max_step=p.target_step)
            target = info.step if info else p.target_step
            return Spend(max(self.run.step_count - target, 0), 0)
        if isinstance(p, SkipBatchesParams):
            return Spend(0, max(p.to_step - p.from_step + 1, 0) + p.extra)
        return Spend(0, 0)

    def cost(self) -> Cost:
        c = self.run.counters
        return Cost(
            self.run.step_count,
            self.narrator.rerun_steps,
            c.skipped_batches,
            c.skipped_steps,
            self.lr.effective(),
        )

    def planned_steps(self) -> int:
        """The run's length for the recovery budget: max_steps, else what the loader holds, else the
        steps run so far."""
        if self.run.max_steps is not None:
            return self.run.max_steps
        loader = self.position.loader
        if isinstance(loader, GuardedLoader) and loader.batches_per_epoch:
            spans = list(self.position.spans.values())
            per_step = sum(b - a + 1 for a, b in spans) / len(spans) if spans else 1.0
            return int(loader.batches_per_epoch * (loader.epochs or 1) / max(per_step, 1.0))
        return self.run.counters.steps  # (a framework's stream has no length)

    # -- what actions do (actions.Steerable) ------------------------------------------
    def rollback(
        self, target_step: int, checkpoint_id: str | None = None, onset_step: int | None = None
    ) -> str:
        """Every rank calls it at the same step; rank 0 chooses the checkpoint, every rank loads
        that one (or, when a rank cannot read it, all the next older healthy one), or all fail.
        ``onset_step``: the incident's onset, for when the target has rotated out
        (CheckpointKeeper.rollback_candidates)."""
        self.checkpoints.saver.wait()  # the checkpoint it needs may still be being written
        self.checkpoints.drain()
        # Rank 0 chooses once its own saves are on disk (waited for above); the rest follow.
        candidates, note = self.checkpoints.agreed_rollback_candidates(
            target_step, checkpoint_id, onset_step
        )
        loaded = self.checkpoints.load_agreed(candidates)
        info = loaded.info
        if loaded.passed:
            note += f" (passed over {'; '.join(loaded.passed)})"
        if info is None:
            raise ActionFailed(
                f"no checkpoint at or before step {target_step} to roll back to{note}"
            )
        run = self.run
        from_step = run.step_count
        run.generation += 1
        run.step_count = info.step
        run.should_stop = False
        self.position.rewind(info.step)
        run.counters.rollbacks += 1
        for listener in self.rollback_listeners:
            try:
                listener(from_step, info.step)
            except Exception:
                log.exception("spikeguard: on_rollback listener %r raised", listener)
        return f"rolled back to step {info.step} ({info.checkpoint_id}), now epoch {run.generation}{note}"

    def skip_steps(
        self, from_step: int, to_step: int, extra: int = 0, after_rollback: bool = False
    ) -> str:
        start, end, steps = self.position.skip_steps(from_step, to_step, extra, after_rollback)
        self.run.counters.skipped_batches += end - start + 1
        self.run.counters.skipped_steps += steps
        text = f"skipping batches {start}..{end}"
        if end - start + 1 != steps:  # gradient accumulation: say both
            text += f" ({end - start + 1} micro-batches, {steps} optimizer steps)"
        loader = self.position.loader  # (a framework's stream has no end it knows)
        data_end = loader.data_end() if isinstance(loader, GuardedLoader) else None
        if isinstance(loader, GuardedLoader) and data_end is not None and end >= data_end:
            log.warning(
                "spikeguard: the skip window %d..%d reaches past the end of the data (its last "
                "batch is %d): this pass ends %d batches early; guard.data(loader, max_steps=N) "
                "reads the data again to reach N steps instead",
                start,
                end,
                data_end - 1,
                min(end, data_end - 1) - max(start, loader.position) + 1,
            )
        return text

    def request_checkpoint(self, action: Action, reason: str) -> None:
        self.checkpoints.request(action, reason)

    def request_stop(self, reason: str) -> None:
        self.run.request_stop(reason)

    def say_alert(self, step: int, severity: str, message: str) -> None:
        self.narrator.alert(step, severity, message)

    # -- the Guard's own update skips -------------------------------------------------
    def local_skip(self, step: int, reason: str | None, why: str) -> str | None:
        """Say the Guard's own update skip out loud; in observe mode say it would, and do not."""
        if self.mode is GuardMode.OBSERVE:
            self.run.counters.actions_withheld += 1
            self.narrator.would_skip_update(step, why, reason or "")
            return None
        log.warning(
            "spikeguard: skipped the update of step %d: %s; cost: 1 update, no rollback", step, why
        )
        return reason
