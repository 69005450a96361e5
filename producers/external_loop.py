"""The Guard for a training loop someone else runs (HF Trainer, Lightning): the step in two halves.

A framework calls ``optimizer.step()`` and ``scheduler.step()`` itself, so
``guard.step(loss)`` (which calls both) cannot be used. A callback calls the
same two halves ``Guard.step`` is made of, around the framework's own step:

- :meth:`~spikeguard.producers.guard.Guard.before_update` (after the backward,
  before the framework's ``optimizer.step()``): statistics, actions due, the
  local skip rule, clipping: everything ``Guard.step`` does before its update,
  AMP, rank sync, re-runs, mode and recovery budget included. When the update
  is not to happen every gradient is set to ``None`` (producers/update.py).
- :meth:`~spikeguard.producers.guard.Guard.after_update` (after the
  framework's step, scheduler included): the StepEvent, checkpoints, acks.

What differs is only what the framework owns:

- Step numbers are the framework's: ``before_update(loss, step=global_step)``.
- The Guard's LR factor is applied around the framework's ``optimizer.step()``
  (set at the end of the first half, put back by the optimizer's step
  post-hook), so the scheduler reads and writes its own values (lr.py).
- A step the Guard voids still goes through the framework's step: the
  scaler's state (and, when a rollback or stop ended the step, the scheduler's
  and the LR) is put back after it, as if that step had not happened, as in
  ``Guard.step``. A framework counts the step that a stop ended.
- The framework owns the data loader and cannot be made to re-read a batch
  (its iterator lives inside its loop), so the data is a stream that never
  goes back (:class:`BatchStream`): after a rollback the run goes on with the
  batch after the last one read, and the batches of the rolled-back stretch
  are never read again — the data that led into the trouble is skipped by the
  rollback itself, as PaLM's restarts skipped it. A skip window that reaches
  past the current batch voids the updates of the steps that read those
  batches; they are not published.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, NamedTuple

import torch

from spikeguard.errors import ConfigError
from spikeguard.producers.config import ResumeMode
from spikeguard.producers.data import merge_ranges
from spikeguard.producers.amp import ScalerControl
from spikeguard.producers.guard import Guard
from spikeguard.producers.ledger import apply_restart_facts
from spikeguard.producers.lr import LRControl
from spikeguard.producers.narration import RunSummary
from spikeguard.producers.run_state import RunState
from spikeguard.producers.step_halves import StepResult
from spikeguard.producers.update import torch_optimizer, void_update

log = logging.getLogger("spikeguard.producers.guard")


class BatchStream:
    """The framework's batches as the Guard's data position sees them: a count that never goes back.

    Speaks the part of :class:`~spikeguard.producers.data.GuardedLoader` that
    :class:`~spikeguard.producers.parts.DataPosition` uses (spans per step,
    skip ranges, state). Loading a state never moves the count back (a
    rollback does not rewind the framework's data); a restarted process takes
    the saved count.
    """

    def __init__(self) -> None:
        self.position = 0  # the global index of the next batch the framework reads
        self.last_index: int | None = None
        self.ran_out = False
        self.skip_ranges: list[list[int]] = []
        self._span = (-1, -1, 0)

    def read(self) -> bool:
        """The framework read its next batch; True when that batch is inside a skip window."""
        index = self.position
        self.position += 1
        self.last_index = index
        first, _, count = self._span
        self._span = (index if count == 0 else first, index, count + 1)
        return self.skipped(index)

    def span_skipped(self) -> bool:
        """Whether a batch read since the last ``take_span`` (this step's) is inside a skip window."""
        first, last, count = self._span
        return count > 0 and any(a <= last and first <= b for a, b in self.skip_ranges)

    def take_span(self) -> tuple[int, int, int]:
        span, self._span = self._span, (-1, -1, 0)
        return span

    def skip(self, start: int, end: int) -> None:
        self.skip_ranges = merge_ranges(self.skip_ranges + [[start, end]])

    def skipped(self, index: int) -> bool:
        return any(a <= index <= b for a, b in self.skip_ranges)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "skip_ranges": [list(r) for r in self.skip_ranges]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skip_ranges = merge_ranges(
            self.skip_ranges + [list(r) for r in state.get("skip_ranges", ())]
        )
        self.position = max(self.position, int(state.get("position", 0)))


class LRScaleHooks:
    """The Guard's LR factor around an optimizer step the framework makes.

    The factor goes in at the end of the first half (``apply``), once the actions
    due are applied, and the scheduled values come back in the optimizer's step
    post-hook, before the framework steps its scheduler. Not in a step pre-hook:
    Lightning calls ``optimizer.step(closure)`` and runs the backward and
    ``on_before_optimizer_step`` inside it, after the pre-hooks.
    """

    def __init__(self, lr: LRControl, optimizer: torch.optim.Optimizer) -> None:
        self.lr = lr
        self._saved: list[Any] | None = None
        self.handle = optimizer.register_step_post_hook(lambda *_: self.restore())

    def apply(self) -> None:
        if self._saved is None:
            self._saved = self.lr.apply_scale()

    def restore(self) -> None:
        """The scheduled values back (the scheduler steps from its own value, never the scaled one)."""
        saved, self._saved = self._saved, None
        self.lr.put_back(saved)

    def remove(self) -> None:
        self.restore()
        self.handle.remove()


class Untouched(NamedTuple):
    """What a framework's step over a voided update would change, kept to be put back after it."""

    scaler: dict[str, Any] | None  # its update() would grow or lower the scale
    scheduler: dict[str, Any] | None  # after a rollback or stop only: the step did not happen
    lrs: list[Any] | None  # (the scheduler's step writes the param groups' LR)


class FrameworkLoop:
    """The framework's loop as the step's halves see it (step_halves.LoopOwner): it reads its
    own data (a :class:`BatchStream`) and makes every step, voided ones included."""

    def __init__(
        self, run: RunState, stream: BatchStream, optimizer: Any, scheduler: Any, amp: ScalerControl
    ) -> None:
        self.run, self.stream = run, stream
        self.optimizer, self.scheduler, self.amp = optimizer, scheduler, amp
        self.untouched: Untouched | None = None  # put back after the framework's step
        self.rolled_back = False  # the last second half ended a rolled-back step

    def void_update(self, interrupted: bool) -> None:
        """Every gradient None; the framework's scaler still steps (it must: its unscale was
        recorded) and, after a rollback or stop, its scheduler: both are put back after it."""
        void_update(self.optimizer)
        stepped = interrupted and self.scheduler is not None
        self.untouched = Untouched(
            self.amp.keep(),
            self.scheduler.state_dict() if stepped else None,
            [g["lr"] for g in self.optimizer.param_groups] if stepped else None,
        )

    def data_skipped(self) -> bool:
        return self.stream.span_skipped()  # (a skip window applied in this first half counts too)

    def interrupted_step_done(self, step: int) -> None:
        """The framework made the step a rollback or stop ended: it counts (a stop ends the run
        after it), and its batches are spent."""
        self.stream.take_span()
        self.run.counters.steps += 1
        self.rolled_back = not self.run.should_stop
        if self.run.should_stop:
            self.run.step_count = step + 1


class FrameworkGuard(Guard):
    """A :class:`Guard` driven by a framework's callback through the two halves of its step.

    ``framework_step`` is the framework's global step when training starts: above 0 it
    resumed a run itself (model, optimizer, scheduler), and ``resume`` says whether the
    Guard's own facts follow it (see :meth:`resume`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any = None,
        *,
        framework_step: int = 0,
        **kwargs: Any,
    ) -> None:
        self.framework_step = framework_step
        super().__init__(model, optimizer, scheduler, **kwargs)
        self.stream = BatchStream()
        self.position.attach(self.stream)  # (a resumed data state is handed over here)
        self.hooks = LRScaleHooks(self.lr, torch_optimizer(optimizer))
        self.loop = self.halves.loop = FrameworkLoop(
            self.state, self.stream, optimizer, scheduler, self.amp
        )

    @property
    def rolled_back(self) -> bool:
        """The last second half ended a rolled-back step (the caller moves its step)."""
        return self.loop.rolled_back

    def resume(self, mode: ResumeMode | str = ResumeMode.AUTO) -> Any:
        """The framework resumes the model; the Guard never loads weights over it.

        ``auto``: when the framework resumed, the Guard's own facts follow (applied action ids,
        skip windows, LR factor, clipping, from its ledger file); when it starts at step 0, so
        does the Guard (earlier files moved aside). ``must``: as auto, but a framework that did
        not resume is an error. ``never``: the Guard always starts afresh.
        """
        mode = ResumeMode(mode)
        if mode is ResumeMode.MUST and self.framework_step <= 0:
            raise ConfigError(
                f"resume='must': the framework started run {self.run_id} at step 0; "
                "resume it from its checkpoint (or use resume='auto')"
            )
        if mode is ResumeMode.NEVER or self.framework_step <= 0:
            return super().resume(ResumeMode.NEVER)
        side = self.ledger.read() or {}
        self.generation = max(
            self.generation, apply_restart_facts(side, self.position, self.lr, self.clipper)
        )
        log.warning(
            "spikeguard: the framework resumed run %s at step %d; the Guard's own state follows "
            "(%d applied actions, %d skip windows, LR factor %.3g)%s",
            self.run_id,
            self.framework_step,
            len(self.ledger),
            len(side.get("skip_ranges") or ()),
            self.lr.scale,
            "" if side else " (no ledger file found: nothing to carry over)",
        )
        return None

    def batch_read(self) -> bool:
        """The framework read a (micro-)batch for training; True when it is in a skip window."""
        return self.stream.read()

    def before_update(
        self,
        loss: torch.Tensor | float,
        batch: Any = None,
        closure: Callable[[], torch.Tensor] | None = None,
        *,
        step: int | None = None,
    ) -> bool:
        self.loop.rolled_back = False
        allowed = super().before_update(loss, batch, closure, step=step)
        if allowed:
            self.hooks.apply()
        return allowed

    def after_update(self) -> StepResult:
        self.hooks.restore()  # (already done unless the framework skipped optimizer.step, e.g. fp16 overflow)
        kept, self.loop.untouched = self.loop.untouched, None
        if kept is not None:
            self.amp.put_back(kept.scaler)
            if kept.scheduler is not None:
                self.scheduler.load_state_dict(kept.scheduler)
            self.lr.put_back(kept.lrs)
        return super().after_update()

    def close(self, finished: bool | None = None) -> RunSummary:
        self.hooks.remove()
        return super().close(finished)


def mean_loss(losses: list[torch.Tensor], summed: bool) -> torch.Tensor | float:
    """One step's loss from its micro-batches' (already normalised ones are ``summed``)."""
    if not losses:
        return math.nan
    total = torch.stack([x.detach().float().reshape(()) for x in losses]).sum()
    return total if summed else total / len(losses)
