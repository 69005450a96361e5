"""The parameter change an optimizer step made, kept on device until the next step's statistics.

Whatever the optimizer (Adam's update is not ``lr * grad``), the change is
measured, not modelled: the parameters are copied on device just before the
update into one preallocated buffer per parameter (``torch._foreach_copy_``),
and the copy minus the parameters after it is the update. Nothing is read
then: the Guard's one statistics transfer happens before the update (the skip
rule needs it), so the update waits in its buffers and ``GradStats.compute``
takes its norm at the next step, beside the gradient norms, with the same
kernels and, for a sharded model (FSDP2, DTensor; the buffers are DTensors
laid out as the parameters), in the same fixed-shape all-reduce.

So the StepEvent of step ``s`` carries the update made at step ``s - 1``: the
change that produced the parameters step ``s``'s loss and gradient were
computed at. An update the Guard skipped, or a GradScaler overflow skip, is
0; the first step, and the first step after a rollback (the parameters came
from a checkpoint, not from an update), have none.

Costs: memory for one copy of the (this rank's) parameters, and three passes
over them per step (copy, subtract, and the norm in the statistics). If the
copy cannot be allocated, the measurement turns itself off with a WARNING and
training goes on.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

import torch

from spikeguard.producers.distributed import local_tensors

log = logging.getLogger(__name__)


class _Made(NamedTuple):
    """The buffers hold the update made at ``step`` of ``epoch``."""

    epoch: int
    step: int


class UpdateNorm:
    """Keeps ``params before - params after`` of the last optimizer update, on device."""

    def __init__(self, params: Sequence[torch.nn.Parameter], enabled: bool = True) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.enabled = enabled and bool(self.params)
        self._delta: list[torch.Tensor] | None = None  # DTensors when the parameters are
        self._made: _Made | None = None  # what the buffers hold (None: nothing usable)
        self._measuring: _Made | None = None  # between before_update and after_update

    def last_update(self, step: int, epoch: int) -> list[torch.Tensor] | None:
        """The update that led to step ``step``'s parameters, if the previous step of this epoch made one."""
        made = self._made
        if made is None or made.step != step - 1 or made.epoch != epoch:  # a rollback since
            return None
        return self._delta

    def before_update(self, step: int, epoch: int, applies: bool = True) -> None:
        """Copy the parameters as they are (on device; nothing is read).

        ``applies=False``: the optimizer will not change them (a GradScaler overflow skip).
        """
        self._measuring = None
        if not applies:
            self.skipped(step, epoch)
            return
        if not self._ready():
            return
        assert self._delta is not None
        self._made = None  # the buffers are about to hold something else
        with torch.no_grad():
            torch._foreach_copy_(local_tensors(self._delta), local_tensors(self.params))
        self._measuring = _Made(epoch, step)

    def after_update(self) -> None:
        """The update just made: the copy minus the parameters now."""
        if self._measuring is None or self._delta is None:
            return
        with torch.no_grad():
            torch._foreach_sub_(local_tensors(self._delta), local_tensors(self.params))
        self._made, self._measuring = self._measuring, None

    def skipped(self, step: int, epoch: int) -> None:
        """This step's update was skipped (by the Guard or by the GradScaler): it changed nothing."""
        self._measuring = None
        if not self._ready():
            return
        assert self._delta is not None
        with torch.no_grad():
            torch._foreach_zero_(local_tensors(self._delta))
        self._made = _Made(epoch, step)

    def _ready(self) -> bool:
        if self.enabled and self._delta is None:
            try:
                with torch.no_grad():
                    self._delta = [torch.empty_like(p) for p in self.params]
            except (
                torch.OutOfMemoryError,
                RuntimeError,
            ) as exc:  # its own failure never ends training
                self.enabled = False
                log.warning(
                    "spikeguard: update_norm off for this run: no memory for a copy of the "
                    "parameters (%s); GuardConfig(update_norm=False) says so up front",
                    exc,
                )
        return self.enabled
