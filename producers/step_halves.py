"""A guarded step in its two halves, around the optimizer's (and the scheduler's) step.

:meth:`StepHalves.before_update` (after the backward): the statistics with one
device-to-host transfer (unscaled under a GradScaler, shared across ranks), the
actions due at this step, the local skip rule (skip_rule.py; re-runs, rerun.py)
and clipping; it says whether the update may be applied, and when not every
gradient is ``None`` (update.py). :meth:`StepHalves.after_update`: the
StepEvent, the step's bookkeeping, checkpoints due, acks. ``Guard.step`` calls
both around its own update; a framework's callback calls them around the
framework's (external_loop.py), whose differences are a :class:`LoopOwner`.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import torch

from spikeguard.producers.amp import ScalerControl
from spikeguard.producers.applying import ActionApplier
from spikeguard.producers.checkpointing import CheckpointKeeper
from spikeguard.producers.config import GuardConfig, GuardMode
from spikeguard.producers.distributed import RankSync
from spikeguard.producers.incidents import IncidentRecorder
from spikeguard.producers.inbox import ActionInbox
from spikeguard.producers.lockstep import DecisionWaiter
from spikeguard.producers.rerun import RerunCheck
from spikeguard.producers.run_events import RunEvents
from spikeguard.producers.run_plan import RunPlan
from spikeguard.producers.run_state import RunState
from spikeguard.producers.skip_rule import SkipDecision, SkipRule, StepJudged
from spikeguard.producers.stats import GradStats, StepStats, across_ranks
from spikeguard.producers.steering import Steering
from spikeguard.producers.update import void_update
from spikeguard.producers.update_norm import UpdateNorm
from spikeguard.schemas import Action, CheckpointEvent

#: Why a step's update does not happen, besides the skip reasons a StepEvent publishes:
#: a rollback or stop applied in its first half (the step is not published)...
INTERRUPTED = "interrupted"
#: ...or the step read data a skip window covers (a framework's stream; not published either).
SKIPPED_DATA = "skipped_data"
#: The Guard's own update skips (said out loud; withheld in observe mode).
LOCAL_SKIPS = ("non_finite", "outlier_step", "transient")


class FirstHalf(NamedTuple):
    """What ``before_update`` found, for ``after_update`` to publish and count."""

    step: int
    stats: StepStats
    # why the update is void (None: applied; "scaler_overflow": the scaler skipped it)
    reason: str | None
    nonfinite: bool
    overflow: bool  # the scaler's own overflow: inf/NaN gradients with a finite loss
    scored: SkipDecision | None  # the local outlier model's judgement (evidence.py)
    rerun: str | None  # a re-run's verdict (rerun.py)
    loss_scale: float | None
    lr: float  # the LR this update used (the Guard's factor included)


class StepResult(NamedTuple):
    """How a guarded step ended."""

    updated: bool  # the update was applied
    interrupted: bool  # a rollback or stop ended the step before its update


class LoopOwner(Protocol):
    """What differs between the Guard's own loop and a framework's (external_loop.py)."""

    def void_update(self, interrupted: bool) -> None:
        """This step's update does not happen."""

    def data_skipped(self) -> bool:
        """Whether this step read data a skip window covers."""

    def interrupted_step_done(self, step: int) -> None:
        """A rollback or stop ended step ``step`` before its update."""


class OwnLoop:
    """The Guard's own loop: it never reads data a skip window covers, and an interrupted step
    did not happen."""

    def __init__(self, optimizer: Any, amp: ScalerControl) -> None:
        self.optimizer, self.amp = optimizer, amp

    def void_update(self, interrupted: bool) -> None:
        """Every gradient None, the scaler's scale kept."""
        void_update(self.optimizer)
        self.amp.void()

    def data_skipped(self) -> bool:
        return False

    def interrupted_step_done(self, step: int) -> None:
        """Nothing counts."""


class StepHalves:
    """The two halves of every guarded step, over the run's state and the Guard's parts."""

    def __init__(
        self,
        run: RunState,
        *,
        config: GuardConfig,
        plan: RunPlan,
        params: Callable[[], list[torch.nn.Parameter]],
        torch_optimizer: Any,
        stats: GradStats,
        updates: UpdateNorm,
        amp: ScalerControl,
        sync: RankSync,
        skip_rule: SkipRule,
        rerun: RerunCheck,
        applier: ActionApplier,
        checkpoints: CheckpointKeeper,
        events: RunEvents,
        incidents: IncidentRecorder,
        inbox: ActionInbox | None,
        waiter: DecisionWaiter | None,
        loop: LoopOwner,
    ) -> None:
        self.run = run
        self.config = config
        self.plan = plan
        self.params = params  # the parameters a re-run recomputes
        self.torch_optimizer = torch_optimizer  # the one a scaler steps
        self.stats = stats
        self.updates = updates
        self.amp = amp
        self.sync = sync
        self.rank = sync.rank
        self.skip_rule = skip_rule
        self.rerun = rerun
        self.applier = applier
        self.steering: Steering = applier.steering
        self.actions = applier.actions
        self.checkpoints = checkpoints
        self.position = checkpoints.position
        self.health = checkpoints.health
        self.clipper = self.steering.clipper
        self.lr = self.steering.lr
        self.events = events
        self.incidents = incidents
        self.inbox = inbox
        self.waiter = waiter
        self.loop = loop
        self.half: FirstHalf | None = None  # between before_update and after_update
        self.signals: Any = None  # opt-in mechanism signals (producers/signals/prevention.py)
        self.started = False
        self.batch_seen = False
        self.outlier_note = "an isolated outlier step"  # the skip rule's words for the last one

    @property
    def interrupted(self) -> bool:
        return self.half is not None and self.half.reason == INTERRUPTED

    # -- the run's start and its batches ------------------------------------------------
    def start(self) -> None:
        """Announce the run (once) and save a rollback target before anything can go wrong."""
        if self.started:
            return
        self.started = True
        run, store = self.run, self.checkpoints.store
        resumed = run.resumed_from is not None
        self.events.run(
            "start",
            self.plan,
            run.max_steps,
            run.step_count,
            run.generation,
            False,
            "resumed" if resumed else "new",
        )
        if resumed and self.rank == 0:
            # A new session starts the run afresh in the pipeline: it learns the rollback
            # targets this run resumes with from this session, not from the one before.
            for info in reversed(store.list()):
                self.events.checkpoint(
                    CheckpointEvent(
                        run_id=run.run_id,
                        step=info.step,
                        epoch=info.epoch,
                        checkpoint_id=info.checkpoint_id,
                        path=str(info.path),
                        healthy=info.healthy,
                    ),
                    [],
                )
        # On every rank or on none: rank 0 decides (a rank that starts late would find rank 0's
        # checkpoint and skip its own).
        if self.sync.share(store.newest() is None and self.checkpoints.saver.in_flight is None):
            self.checkpoints.save("periodic")

    def end(self, finished: bool | None, ran_out: bool) -> None:
        """The run is closed: whether it finished (None: the planned steps ran, or the data ran
        out), the ledger on disk, and the run's end announced if its start was."""
        run = self.run
        if finished is None:
            planned = run.max_steps is not None and run.step_count >= run.max_steps
            finished = not run.should_stop and (planned or ran_out)
        run.finished = run.finished or finished
        self.checkpoints.persist_ledger()
        if self.started:
            self.events.run(
                "end",
                self.plan,
                run.max_steps,
                run.step_count,
                run.generation,
                run.finished,
                run.stop_reason or ("finished" if run.finished else "closed"),
            )

    def batch_read(self, batch: Any, used: bool) -> None:
        self.incidents.batch(batch, used)
        if used and not self.batch_seen:  # reading a batch may draw from the global RNG: after it
            self.batch_seen = True
            self.rerun.before_step()

    # -- the first half -------------------------------------------------------------------
    def before_update(
        self, loss: torch.Tensor | float, batch: Any, closure: Callable[[], torch.Tensor] | None
    ) -> bool:
        run, sync, counters = self.run, self.sync, self.run.counters
        step = run.step_count
        self.applier.collect(step)
        actions = self.actions
        due = actions.due(step) if self.rank == 0 and actions.pending else []
        # (off, the update norm's calls change nothing: UpdateNorm only ever turns itself off)
        updates = self.updates if self.updates.enabled else None
        amp = self.amp.enabled  # (a scaler is on or off for the whole run)
        if amp:
            self.amp.begin(self.torch_optimizer)  # statistics and clipping: unscaled gradients
        stats, grads = self.stats.compute(
            loss,
            batch,
            self._riders(bool(due)) if sync.enabled else None,
            updates.last_update(step, run.generation) if updates is not None else None,
        )
        if sync.enabled:  # the run's loss (the largest rank's) is what is judged and published
            stats = across_ranks(stats, sync.world_size)
        shared = stats.riders
        loss_scale = self.amp.scale() if amp else None
        # Under a GradScaler an inf/NaN gradient with a finite loss is the scaler's own business.
        overflow = amp and math.isfinite(stats.loss) and not stats.finite
        if sync.enabled:
            nonfinite = shared["any_nonfinite"] > 0
        else:
            nonfinite = not math.isfinite(stats.loss) if amp else not stats.finite
        interrupted = False
        if shared["any_due"] > 0 if sync.enabled else bool(due):
            if sync.enabled:
                sent = [a.model_dump(mode="json") for a in due] if self.rank == 0 else None
                due = [Action.model_validate(d) for d in sync.broadcast(sent)]
            interrupted = self.applier.apply(
                due, step
            )  # rolled back or stopped: the update is void
        reason: str | None = None
        scored, rerun = None, None
        lr: float | None = None  # the LR this update uses, once looked at (LRControl.effective)
        if interrupted:
            reason = INTERRUPTED
        elif self.loop.data_skipped():
            reason = SKIPPED_DATA
        else:
            reason = "non_finite" if nonfinite and self.config.skip_nonfinite else None
            judged = None
            if reason is None and not overflow:
                lr = self.lr.effective()
                judged = self._judge_outlier(stats, lr)
                reason = "outlier_step" if self._skips(judged) else None
            if (
                reason is not None
                and self.rerun.enabled
                and self.steering.mode is not GuardMode.OBSERVE
                and not (sync.enabled or amp)
            ):
                # (one rank's re-run would split the ranks; a scaler's re-run gradients come scaled)
                stats, rerun = self.rerun.judge(closure, self.params(), stats)
                if rerun == "transient":
                    # The re-run recomputed the same batch on the same weights: when its own values
                    # are clean, its gradient is the step's true one and its update is applied.
                    counters.transient_steps += 1
                    nonfinite = not stats.finite
                    judged = None if nonfinite else self._judge_outlier(stats, self.lr.effective())
                    reason = "transient" if nonfinite or self._skips(judged) else None
                    grads = self.stats.clip_targets()  # the re-run's gradients, not the fault's
            if judged is not None:  # what is learned is what is published: a re-run's values
                self.skip_rule.learn(judged)
                scored = judged.decision
                if reason == "outlier_step":
                    self._found_outlier(judged.decision)
            if reason in LOCAL_SKIPS:
                reason = self.steering.local_skip(step, reason, self._why(reason, stats))
            if reason is not None:
                counters.skipped_updates += 1
        if reason is not None:
            self.loop.void_update(interrupted)
            if updates is not None:
                updates.skipped(step, run.generation)
        else:
            if stats.grad_norm is not None and not overflow:
                self.clipper.clip(grads, stats.grad_norm)
            if updates is not None:  # (a scaler's overflow: an update of 0)
                updates.before_update(step, run.generation, applies=not overflow)
            if overflow:  # the scaler skips this update itself
                reason = "scaler_overflow"
                counters.scaler_skips += 1
            else:
                counters.updates += 1
            if stats.grad_norm is not None:
                self.clipper.observe(stats.grad_norm)
        if self.signals is not None:
            self.signals.before_update()
            lr = None  # (opt-in signals act on the model: the LR is looked at again after them)
        # Looking at one scheduled LR twice gives the same answer (LRControl.multiplier).
        lr = self.lr.effective() if lr is None else lr
        self.half = FirstHalf(
            step, stats, reason, nonfinite, overflow, scored, rerun, loss_scale, lr
        )
        return reason in (None, "scaler_overflow")

    def _riders(self, due: bool) -> Any:
        """The ranks' flags and losses, gathered on device, ride along with the statistics' one transfer."""
        sync = self.sync
        if not sync.enabled:
            return None
        if self.amp.enabled:  # an inf gradient is the scaler's overflow; only the loss counts here
            return lambda bad, loss, norm: sync.flags(
                (~torch.isfinite(loss)).float(), due, loss, norm
            )
        return lambda bad, loss, norm: sync.flags(bad, due, loss, norm)

    def _judge_outlier(self, stats: StepStats, lr: float) -> StepJudged:
        """The local outlier model's judgement (not yet learned) at the step's LR ``lr``, on values
        every rank shares (the largest of any rank)."""
        grad: float | None
        if self.sync.enabled:
            r = stats.riders
            loss, grad = r["max_loss"], r["max_grad_norm"]
        else:
            loss, grad = stats.loss, stats.grad_norm
        return self.skip_rule.judge(loss, None if grad is None or grad < 0 else grad, lr)

    def _skips(self, judged: StepJudged | None) -> bool:
        """Whether the local rule skips a judged step (it always scores; it skips with skip_outliers)."""
        return judged is not None and judged.decision.skip and self.config.skip_outliers

    def _found_outlier(self, decision: SkipDecision) -> None:
        self.run.counters.outlier_skips += 1
        # The rule's measure is the residual over its threshold (1.0 at the threshold): said as
        # a multiple of the threshold, so that 1.1 does not read as an ordinary 1.1 sigma.
        self.outlier_note = (
            f"{decision.signal} outlier (loss at {_over(decision.loss_z)} its outlier threshold, "
            f"grad norm at {_over(decision.grad_z)})"
        )

    def _why(self, reason: str, stats: StepStats) -> str:
        if reason == "non_finite":
            if not math.isfinite(stats.loss):
                return f"non-finite loss (loss {stats.loss:.4g})"
            return f"non-finite gradient (grad norm {stats.grad_norm:.4g}, loss {stats.loss:.4g})"
        if reason == "transient":
            return "a re-run of the step came out different (a transient device fault)"
        return self.outlier_note

    # -- the second half ------------------------------------------------------------------
    def after_update(self) -> StepResult:
        half, self.half = self.half, None
        if half is None:
            return StepResult(False, False)
        run, counters = self.run, self.run.counters
        if self.updates.enabled:
            self.updates.after_update()  # the update just made, if the first half allowed it
        measured = self.signals.after_update() if self.signals is not None else _NO_SIGNALS
        step, stats, reason = half.step, half.stats, half.reason
        if reason == INTERRUPTED:
            self.loop.interrupted_step_done(step)
            self.checkpoints.save_if_due(requests_only=True)
            self.checkpoints.drain()
            self.applier.finish()
            return StepResult(False, True)
        if reason in (None, "scaler_overflow"):
            self.amp.count(half.overflow)
        if reason != SKIPPED_DATA:  # (a step whose data a skip window covers is not published)
            loader = self.position.loader
            self.events.step(
                step,
                run.generation,
                stats,
                lr=half.lr,
                reason=reason,
                loss_scale=half.loss_scale,
                overflow_streak=self.amp.streak,
                batch_index=loader.last_index if loader is not None else None,
                rerun=half.rerun,
                outlier=half.scored is not None and half.scored.skip,
                signals=measured,
            )
            self.actions.published.keep(  # own_view's arguments: the view made if cited
                run.generation,
                step,
                (
                    half.nonfinite,
                    half.overflow,
                    half.scored,
                    bool(measured) and self.signals.over,
                    stats.loss,  # checked against action evidence
                    None if reason == "scaler_overflow" else stats.grad_norm,
                ),
            )
            # a local onset
            self.health.observe(
                step, not (half.nonfinite or reason in ("outlier_step", "transient"))
            )
        batches = self.position.record(step)  # micro-batches this step read (accumulation)
        self.incidents.step(step)
        self.batch_seen = False
        if self.rerun.enabled:
            self.rerun.before_step()  # the next forward's random streams (again at its first batch)
        if reason in LOCAL_SKIPS:
            counters.skipped_update_batches += batches
        run.step_count = step + 1
        counters.steps += 1
        self.checkpoints.save_if_due()
        self.checkpoints.drain()
        self.applier.finish()
        if self.waiter is not None and reason != SKIPPED_DATA:
            self.waiter.follow(self.inbox, run.generation, step, self.config.lockstep_settle)
        return StepResult(reason is None, False)


#: what a step without the opt-in mechanism signals measured (read only)
_NO_SIGNALS: Mapping[str, float] = MappingProxyType({})


def _over(value: float | None) -> str:
    """A residual over its threshold, said as a multiple; a point below its level is said so
    (its residual is negative: "-0.03x its threshold" reads as nothing)."""
    if value is None:
        return "n/a"
    return "below its level" if value < 0.0 else f"{value:.2f}x"
