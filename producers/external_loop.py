"""The Guard for a training loop someone else runs (HF Trainer, Lightning): the step in two halves.

A framework calls ``optimizer.step()`` and ``scheduler.step()`` itself, so
``guard.step(loss)`` (which calls both) cannot be used. Its work is split
around the framework's own optimizer step, for a callback to drive:

- :meth:`FrameworkGuard.before_update` (after the backward, before the
  framework's ``optimizer.step()``): the statistics with one device-to-host
  transfer, the actions due, the local skip rule. It returns whether the
  update may be applied; when not, every gradient is set to ``None``, which
  torch optimizers treat as "this parameter takes no step": no moment update,
  no weight decay, no step count (zeroed gradients would still move AdamW).
- :meth:`FrameworkGuard.after_update` (after the framework's step, scheduler
  included): the StepEvent, checkpoints, and the rollback or stop held back
  from the first half, which must come after the framework's own bookkeeping
  (a rollback done before it would see the scheduler stepped once more).

Step numbers are the framework's: each half is told the framework's global
step. The Guard's LR factor is applied around the framework's
``optimizer.step()`` (set at the end of the first half, put back by the
optimizer's step post-hook), so the scheduler reads and writes its own values
and the factor composes with them (lr.py).

The framework owns the data loader and cannot be made to re-read a batch
(its iterator lives inside its loop), so the data is a stream that never goes
back (:class:`BatchStream`): after a rollback the run goes on with the batch
after the last one read, and the batches of the rolled-back stretch are never
read again — the data that led into the trouble is skipped by the rollback
itself, as PaLM's restarts skipped it. A skip window that reaches past the
current batch voids the updates of the steps that read those batches; they
are not published.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from spikeguard.errors import ConfigError
from spikeguard.producers.config import ResumeMode
from spikeguard.producers.data import merge_ranges
from spikeguard.producers.evidence import own_view
from spikeguard.producers.guard import Guard
from spikeguard.producers.ledger import apply_restart_facts
from spikeguard.producers.narration import RunSummary
from spikeguard.schemas import ActionKind

log = logging.getLogger("spikeguard.producers.guard")

#: Actions that end the step they are due at; applied in the second half.
INTERRUPTING = frozenset({ActionKind.ROLLBACK, ActionKind.STOP})


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
        self.skip_ranges = merge_ranges(self.skip_ranges + [list(r) for r in state.get("skip_ranges", ())])
        self.position = max(self.position, int(state.get("position", 0)))


class LRScaleHooks:
    """The Guard's LR factor around an optimizer step the framework makes.

    The factor goes in at the end of the first half (``apply``), once the actions
    due are applied, and the scheduled values come back in the optimizer's step
    post-hook, before the framework steps its scheduler. Not in a step pre-hook:
    Lightning calls ``optimizer.step(closure)`` and runs the backward and
    ``on_before_optimizer_step`` inside it, after the pre-hooks.
    """

    def __init__(self, lr: Any, optimizer: torch.optim.Optimizer) -> None:
        self.lr = lr
        self.optimizer = optimizer
        self._saved: list[Any] | None = None
        self.handle = optimizer.register_step_post_hook(lambda *_: self.restore())

    def apply(self) -> None:
        if self.lr.scale == 1.0 or self._saved is not None:
            return
        groups = self.optimizer.param_groups
        self._saved = [g["lr"] for g in groups]
        for g, lr in zip(groups, self._saved):
            value = (lr.item() if isinstance(lr, torch.Tensor) else lr) * self.lr.scale
            g["lr"] = lr.clone().fill_(value) if isinstance(lr, torch.Tensor) else value

    def restore(self) -> None:
        """The scheduled values back (the scheduler steps from its own value, never the scaled one)."""
        if self._saved is not None:
            for g, lr in zip(self.optimizer.param_groups, self._saved):
                g["lr"] = lr
            self._saved = None

    def remove(self) -> None:
        self.restore()
        self.handle.remove()


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (accelerate's ``.optimizer``, Lightning's)."""
    inner = optimizer
    # (accelerate's AcceleratedOptimizer is an Optimizer subclass around the real one)
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer) or (
            not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer")):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"no torch optimizer found in {type(optimizer).__name__}")
    return inner


def void_update(optimizer: Any) -> None:
    """Make the coming ``optimizer.step()`` change nothing: every gradient is None."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


class FrameworkGuard(Guard):
    """A :class:`Guard` driven by a framework's callback through two halves of a step.

    ``framework_step`` is the framework's global step when training starts: above 0 it
    resumed a run itself (model, optimizer, scheduler), and ``resume`` says whether the
    Guard's own facts follow it (see :meth:`resume`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any, scheduler: Any = None, *,
                 framework_step: int = 0, **kwargs: Any) -> None:
        self.framework_step = framework_step
        super().__init__(model, optimizer, scheduler, **kwargs)
        self.stream = BatchStream()
        self.position.attach(self.stream)  # (a resumed data state is handed over here)
        self.hooks = LRScaleHooks(self.lr, torch_optimizer(optimizer))
        self._held: list[Any] = []  # due rollback/stop (and what came with them) for the second half
        self._step: dict[str, Any] | None = None  # the first half's findings, for the second
        self.rolled_back = False  # the last second half rolled back (the caller moves its step)

    def resume(self, mode: ResumeMode | str = ResumeMode.AUTO) -> Any:
        """The framework resumes the model; the Guard never loads weights over it.

        ``auto``: when the framework resumed, the Guard's own facts follow (applied action ids,
        skip windows, LR factor, clipping, from its ledger file); when it starts at step 0, so
        does the Guard (earlier files moved aside). ``must``: as auto, but a framework that did
        not resume is an error. ``never``: the Guard always starts afresh.
        """
        mode = ResumeMode(mode)
        if mode is ResumeMode.MUST and self.framework_step <= 0:
            raise ConfigError(f"resume='must': the framework started run {self.run_id} at step 0; "
                              "resume it from its checkpoint (or use resume='auto')")
        if mode is ResumeMode.NEVER or self.framework_step <= 0:
            return super().resume(ResumeMode.NEVER)
        side = self.ledger.read() or {}
        self.epoch = max(self.epoch, apply_restart_facts(side, self.position, self.lr, self.clipper))
        log.warning("spikeguard: the framework resumed run %s at step %d; the Guard's own state follows "
                    "(%d applied actions, %d skip windows, LR factor %.3g)%s", self.run_id,
                    self.framework_step, len(self.ledger), len(side.get("skip_ranges") or ()), self.lr.scale,
                    "" if side else " (no ledger file found: nothing to carry over)")
        return None

    def batch_read(self) -> bool:
        """The framework read a (micro-)batch for training; True when it is in a skip window."""
        return self.stream.read()

    def before_update(self, step: int, loss: torch.Tensor | float) -> bool:
        """After the backward, before the framework's optimizer step; False: the update is voided."""
        self._start()
        self.step_count = step
        self.rolled_back = False
        self._collect(step)
        due = self.actions.due(step)
        stats, grads = self.stats.compute(loss)
        nonfinite = not stats.finite
        held = any(a.kind in INTERRUPTING for a in due)
        if held:
            self._held = due  # applied after the framework's step, in order
        elif due:
            self._apply(due, step)
        skipped_data = self.stream.span_skipped()  # (a skip window applied just now counts too)
        reason, scored = None, None
        if held or skipped_data:
            reason = "held"
        elif nonfinite and self.config.skip_nonfinite:
            reason = "non_finite"
        else:
            reason, scored = self._outlier(step, stats)
        reason = self._local_skip(step, reason, stats)  # said out loud; observe mode: not taken
        if reason is None:
            if stats.grad_norm is not None:
                self.clipper.clip(grads, stats.grad_norm)
                self.clipper.observe(stats.grad_norm)
            self.counters["updates"] += 1
        else:
            void_update(self.optimizer)
            if reason != "held":
                self.counters["skipped_updates"] += 1
        self._step = dict(step=step, stats=stats, reason=reason, nonfinite=nonfinite, scored=scored,
                          skipped_data=skipped_data, lr=self.lr.effective())
        self.hooks.apply()
        return reason is None

    def after_update(self) -> bool:
        """After the framework's optimizer (and scheduler) step; True when the run rolled back or stops."""
        found, self._step = self._step, None
        if found is None:
            return False  # no first half (e.g. a micro-batch of an accumulation)
        self.hooks.restore()  # (already done unless the framework skipped optimizer.step, e.g. fp16 overflow)
        step, stats, reason = found["step"], found["stats"], found["reason"]
        batches = self.position.record(step)
        if reason != "held":
            self.events.step(step, self.epoch, stats, lr=found["lr"], reason=reason, loss_scale=None,
                             overflow_streak=0, batch_index=self.stream.last_index)
            self.actions.published.remember(self.epoch, step, stats.loss, stats.grad_norm,
                                            own_view(found["nonfinite"], False, found["scored"]))
            self.health.observe(step, not (found["nonfinite"] or reason == "outlier_step"))
            if reason in ("non_finite", "outlier_step"):
                self.counters["skipped_update_batches"] += batches
        self.step_count = step + 1
        self.counters["steps"] += 1
        held, self._held = self._held, []
        interrupted = bool(held) and self._apply(held, self.step_count)
        self.rolled_back = interrupted and not self.should_stop
        self._maybe_checkpoint(requests_only=interrupted)
        self._drain_saves()
        self._finish_actions()
        if self.waiter is not None and reason != "held":
            self.waiter.follow(self.inbox, self.epoch, step, self.config.lockstep_settle)
        return interrupted

    def close(self, finished: bool | None = None) -> RunSummary:
        self.hooks.remove()
        return super().close(finished)


def mean_loss(losses: list[torch.Tensor], summed: bool) -> torch.Tensor | float:
    """One step's loss from its micro-batches' (already normalised ones are ``summed``)."""
    if not losses:
        return math.nan
    total = torch.stack([x.detach().float().reshape(()) for x in losses]).sum()
    return total if summed else total / len(losses)
