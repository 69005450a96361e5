"""The norm of the parameter change an optimizer step made, at no extra device-to-host transfer.

Whatever the optimizer (Adam's update is not ``lr * grad``), the change is
measured, not modelled: the parameters are copied on device just before the
update (one preallocated buffer per parameter, ``torch._foreach_copy_``), the
copy minus the parameters after it is the update, and its norm stays on the
device. Nothing is read then: the Guard's statistics transfer happens before
the update (the skip rule needs it), so the norm rides along with the *next*
step's transfer, as one more named rider of ``GradStats.compute``.

So the StepEvent of step ``s`` carries the update made at step ``s - 1``: the
change that produced the parameters step ``s``'s loss and gradient were
computed at. An update the Guard skipped, a GradScaler overflow skip, is 0;
the first step, and the first step after a rollback (the parameters came from
a checkpoint, not from an update), have none.

With a sharded model (FSDP2, DTensor) the buffers are DTensors laid out as the
parameters; the arithmetic runs on this rank's slices and the whole norm comes
from ``sharded_norms`` (one all-reduce, the same fixed shape on every rank).

Costs: memory for one copy of the (local) parameters, and three passes over
them per step (copy, subtract, norm). If the copy cannot be allocated, the
measurement turns itself off with a WARNING and training goes on.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from spikeguard.producers.distributed import is_sharded, local_tensors, sharded_norms

log = logging.getLogger(__name__)

#: The rider's name in ``StepStats.riders``.
RIDER = "update_norm"

Riders = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], Mapping[str, torch.Tensor]]


class _Measured(NamedTuple):
    """The norm (on device) of the update made at ``step`` of ``epoch``."""

    epoch: int
    step: int
    norm: torch.Tensor


class UpdateNorm:
    """Measures ``||params after - params before||`` around each optimizer update."""

    def __init__(self, params: Sequence[torch.nn.Parameter], enabled: bool = True) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.enabled = enabled and bool(self.params)
        self.sharded = is_sharded(self.params)
        self._before: list[torch.Tensor] | None = None  # the copies (DTensors when sharded)
        self._measured: _Measured | None = None
        self._measuring: tuple[int, int] | None = None  # (epoch, step) between before and after

    def riders(self, step: int, epoch: int, others: Riders | None) -> Riders | None:
        """``others`` plus the previous step's update norm, when there is one for ``step``."""
        m = self._measured
        if m is None or (m.epoch, m.step) != (epoch, step - 1):  # none yet, or a rollback since
            return others

        def with_update(bad: torch.Tensor, loss: torch.Tensor,
                        norm: torch.Tensor | None) -> Mapping[str, torch.Tensor]:
            riding = dict(others(bad, loss, norm)) if others is not None else {}
            riding[RIDER] = m.norm
            return riding
        return with_update

    def before_update(self, step: int, epoch: int, applies: bool = True) -> None:
        """Copy the parameters as they are (on device; nothing is read).

        ``applies=False``: the optimizer will not change them (a GradScaler overflow skip).
        """
        self._measuring = None
        if not applies:
            self.skipped(step, epoch)
            return
        if not self.enabled or (self._before is None and not self._allocate()):
            return
        assert self._before is not None
        with torch.no_grad():
            torch._foreach_copy_(local_tensors(self._before), local_tensors(self.params))
        self._measuring = (epoch, step)

    def after_update(self) -> None:
        """The update just made is the copy minus the parameters now: its norm, kept on device."""
        if self._measuring is None or self._before is None:
            return
        (epoch, step), self._measuring = self._measuring, None
        with torch.no_grad():
            delta = local_tensors(self._before)
            torch._foreach_sub_(delta, local_tensors(self.params))
            if self.sharded:
                norms = sharded_norms(self._before, like=self.params)
            else:
                norms = torch.stack([n.float() for n in torch._foreach_norm(delta)])
            self._measured = _Measured(epoch, step, torch.linalg.vector_norm(norms))

    def skipped(self, step: int, epoch: int) -> None:
        """This step's update was skipped (by the Guard or by the GradScaler): it changed nothing."""
        self._measuring = None
        if self.enabled:
            device = local_tensors(self.params[:1])[0].device
            self._measured = _Measured(epoch, step, torch.zeros((), device=device))

    def _allocate(self) -> bool:
        try:
            with torch.no_grad():
                self._before = [torch.empty_like(p) for p in self.params]
            return True
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # its own failure never ends training
            self.enabled, self._before = False, None
            log.warning("spikeguard: update_norm off for this run: no memory for a copy of the "
                        "parameters (%s); set GuardConfig(update_norm=False) to say so", exc)
            return False
