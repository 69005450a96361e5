"""The mistakes a training loop makes with the Guard, caught where they happen and named.

A mistake that passes silently costs a run (two updates per batch, a loss
that is not the loss); one that fails with a message from deep inside torch
costs an afternoon. Each check here raises, at the step where the mistake
shows, an error that says what is wrong and what to write instead.
"""

from __future__ import annotations

import logging
import numbers
import weakref
from typing import Any

import torch

from spikeguard.errors import SpikeguardError


class GuardMisuse(SpikeguardError, RuntimeError):
    """The training loop uses the Guard in a way that would train wrongly; the message says how."""


def check_loss(loss: Any) -> None:
    """The loss ``guard.step`` takes: a tensor of one element (after backward) or a real number."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:
            raise ValueError(
                f"guard.step(loss) got a loss of shape {tuple(loss.shape)}: one value per sample? "
                "Reduce it to one number first, as backward() needs: loss.mean() (or loss.sum())"
            )
        return
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return
    kind = type(loss)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    raise TypeError(
        f"guard.step(loss) got a {name}: the loss is "
        "the scalar torch.Tensor you called backward() on (or a Python float), e.g. "
        "guard.step(loss), not a string, an array or loss.tolist()"
    )


def guard_options_error(options: dict[str, Any], settings: set[str]) -> TypeError:
    """The error for keyword arguments ``Guard()`` does not take, pointing at GuardConfig."""
    known = sorted(k for k in options if k in settings)
    if known:
        given = ", ".join(f"{k}={options[k]!r}" for k in known)
        return TypeError(
            f"Guard() got {given}: {'these are' if len(known) > 1 else 'this is a'} GuardConfig "
            f"setting{'s' if len(known) > 1 else ''}; pass "
            f"Guard(model, optimizer, config=GuardConfig({given}))"
        )
    unknown = ", ".join(sorted(options))
    return TypeError(
        f"Guard() got an unexpected keyword argument {unknown}; the Guard's settings are "
        "GuardConfig's fields (Guard(..., config=GuardConfig(...)), see docs/guard.md)"
    )


class StepWatch:
    """Sees two updates for one batch: ``guard.step`` twice, or ``optimizer.step()`` beside it;
    and a schedule stepped twice: ``scheduler.step()`` beside it.

    The optimizer's step count comes from a post-step hook (no per-step cost
    but one integer); a loop's batches from the Guard's loader; the scheduler's
    steps from its ``last_epoch``, which only ``step()`` and a loaded state move.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        run_id: str = "",
        scheduler: Any = None,
    ) -> None:
        self.run_id = run_id
        # (a scheduler without torch's step count, a user's own, is not watched)
        self.scheduler = scheduler if hasattr(scheduler, "last_epoch") else None
        self._scheduled: Any = getattr(scheduler, "last_epoch", None)
        self.said_no_data = False
        self.optimizer_steps = 0
        self._expected = 0
        self._last_loss: weakref.ref | None = None
        self._hook = (
            optimizer.register_step_post_hook(self._counted) if optimizer is not None else None
        )

    def _counted(self, *_: Any) -> None:
        self.optimizer_steps += 1

    def before_step(self, loss: Any, loader: Any) -> None:
        """Raises GuardMisuse when this ``guard.step`` would be a batch's second update."""
        if self.optimizer_steps != self._expected:
            raise GuardMisuse(
                "optimizer.step() was called besides guard.step(loss): guard.step makes the "
                "update itself (and scheduler.step()), so every batch was being applied twice. "
                "Remove optimizer.step() (and scheduler.step()) from the loop"
            )
        if self.scheduler is not None and self.scheduler.last_epoch != self._scheduled:
            raise GuardMisuse(
                "scheduler.step() was called besides guard.step(loss): the Guard steps the "
                "scheduler it was given after each update, so the schedule was running twice as "
                "fast. Remove scheduler.step() from the loop (or do not pass the scheduler to "
                "Guard, and step it yourself)"
            )
        same_loss = self._last_loss is not None and self._last_loss() is loss
        if loader is not None and loader.batches_read() == 0:
            if loader.last_index is None:
                raise GuardMisuse(
                    "guard.step(loss) was called, but no batch of guard.data(loader) has been "
                    "read: iterate the wrapped loader (for batch in guard.data(loader): ...), "
                    "not the loader itself, so that the Guard knows which data each step read"
                )
            same_loss = True
        if same_loss:
            raise GuardMisuse(
                "guard.step(loss) was called twice for one batch: each call is an optimizer "
                "update. Call it once per batch (with gradient accumulation, once per "
                "optimizer step, after the last micro-batch's backward)"
            )
        if isinstance(loss, torch.Tensor):
            self._last_loss = weakref.ref(loss)
        if loader is None and not self.said_no_data:
            self.said_no_data = True
            logging.getLogger("spikeguard.producers.guard").warning(
                "spikeguard: run %s: guard.data(loader) was not called, so the Guard does not "
                "know which batches each step reads and cannot skip bad data; a rollback "
                "restores the weights and the loop reads on. Iterate `for batch in "
                "guard.data(loader)` to let it skip",
                self.run_id,
            )

    def after_step(self) -> None:
        """The counts a next ``guard.step`` starts from (after a step, and after a state load)."""
        self._expected = self.optimizer_steps
        if self.scheduler is not None:
            self._scheduled = self.scheduler.last_epoch

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
