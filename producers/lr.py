"""The learning rate as the guard changes it, on top of the user's schedule.

The guard never writes its changes into the optimizer for good: it keeps a
``scale`` and applies it around ``optimizer.step()`` only (set, step, put
back). A scheduler therefore keeps reading and writing the LR it scheduled,
never compounding the guard's factor, and every param group is scaled alike.
The effective LR is always ``scheduled * scale``: a factor composes with
wherever the schedule is now (warm-up, cosine, a user's own scheduler the
guard never sees). ``restore`` raises the scale back towards 1, never above:
it removes the guard's factor and gives the schedule back, exactly. There is
no "base LR" to restore towards: an LR read at start is a warm-up's first
value, and capping at it kept runs at 5 % of their schedule.

A jump of the schedule itself (a mis-set LR window) is a cause that ends when
the schedule comes back down, so its answer is a hold, not a factor: once
``hold_jumps`` is armed (a HOLD_LR action, sent with the rollback past a jump
that damaged the model), a schedule that jumps (x``JUMP_RATIO`` or more in one
step) above the highest LR an update was applied at is held at that peak, and
the schedule is given back exactly at the step it falls to the peak again. The
peak is part of the state, so a rollback restores the checkpoint's: the rate
the run trained at before the jump. A HOLD_LR that arrives while a jump is on
(an LR-induced rise, answered without a rollback) holds that jump at once, at
the peak from before it: the model is not damaged, the cause is the schedule,
and the schedule comes back the step the jump ends (a factor would stay after
it).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

#: One step's rise of the scheduled LR that is a jump, not a warm-up (a linear warm-up grows
#: less than x2 per step after its second step; a blow-up window is x10 and more).
JUMP_RATIO = 2.0


class LRControl:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.scale = 1.0  # the guard's factor on top of the schedule; 1 = the schedule as it is
        self.peak: float | None = None  # group 0's highest LR an update was applied at
        self.hold_jumps = False  # armed: a jump of the schedule above the peak is held there
        self.holding = False  # a jump is held now (until the schedule falls to the peak)
        self._last_scheduled: float | None = None  # group 0's scheduled LR last looked at
        # The peak before the jump of the schedule now on (None: no jump on): what a HOLD_LR
        # that arrives during the jump holds it to.
        self.jump_base: float | None = None

    def scheduled(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def effective(self) -> float:
        """Group 0's LR as the next update will use it."""
        return float(self.optimizer.param_groups[0]["lr"]) * self.multiplier()

    def multiplier(self) -> float:
        """What the next update's LRs are multiplied by: the scale, or less while a jump of the
        schedule is held at the peak. Looking twice at one scheduled LR gives the same answer."""
        scheduled = float(self.optimizer.param_groups[0]["lr"])
        last, self._last_scheduled = self._last_scheduled, scheduled
        wanted = scheduled * self.scale
        jumped = last is not None and scheduled >= JUMP_RATIO * last
        if jumped:
            if self.jump_base is None and self.peak is not None and wanted > self.peak:
                self.jump_base = self.peak
        elif self.jump_base is not None and (
            wanted <= self.jump_base or (last is not None and scheduled > last)
        ):
            self.jump_base = None  # over, or still rising: a warm-up's first doubling, not a jump
        if not self.hold_jumps or self.peak is None or wanted <= self.peak or scheduled <= 0:
            self.holding = False  # (the schedule is back at or below the peak: given back)
            return self.scale
        if not self.holding and jumped:
            self.holding = True
        return self.peak / scheduled if self.holding else self.scale

    def hold(self) -> str:
        """Arm the hold (HOLD_LR), and hold a jump that is on now; says what it holds to."""
        self.hold_jumps = True
        if self.jump_base is not None:
            self.peak, self.holding = self.jump_base, True
            return (
                f"the schedule's jump held at {self.peak:.3g}, the highest LR trained at before "
                "it, until the schedule falls back to it"
            )
        if self.peak is None:
            return "jumps of the schedule held (no update applied yet: nothing to hold them to)"
        return f"jumps of the schedule held at {self.peak:.3g}, the highest LR trained at"

    def scale_by(self, factor: float) -> float:
        _positive(factor, "factor")
        self.scale *= factor
        return self.effective()

    def set(self, lr: float) -> float:
        _positive(lr, "lr")
        scheduled = float(self.optimizer.param_groups[0]["lr"])
        if scheduled <= 0:
            raise ValueError("the scheduled LR is 0; cannot set an LR relative to it")
        self.scale = lr / scheduled
        return self.effective()

    def restore(self, factor: float) -> float:
        _positive(factor, "factor")
        self.scale = min(self.scale * factor, 1.0)
        return self.effective()

    def step(self, optimizer_step: Callable[[], Any]) -> Any:
        """Run ``optimizer_step`` with the guard's scale applied to every group."""
        saved = self.apply_scale()
        try:
            return optimizer_step()
        finally:
            self.put_back(saved)

    def apply_scale(self) -> list[Any] | None:
        """Scale every group's LR for the coming optimizer step; returns the scheduled values
        to ``put_back`` after it (None: nothing was changed)."""
        factor = self.multiplier()
        applied = float(self.optimizer.param_groups[0]["lr"]) * factor
        self.peak = applied if self.peak is None else max(self.peak, applied)
        if factor == 1.0:
            return None
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g, lr in zip(groups, saved):
            _assign(g, lr * factor if not isinstance(lr, torch.Tensor) else lr.item() * factor)
        return saved

    def put_back(self, saved: list[Any] | None) -> None:
        """The scheduled values back: the scheduler steps from its own value, never the scaled one."""
        if saved is not None:
            for g, lr in zip(self.optimizer.param_groups, saved):
                g["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "peak": self.peak,
            "hold_jumps": self.hold_jumps,
            "holding": self.holding,
            "last_scheduled": self._last_scheduled,
            "jump_base": self.jump_base,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # (a checkpoint written before the hold has none of it: no peak known, nothing armed)
        self.scale = float(state.get("scale", 1.0))
        peak, last = state.get("peak"), state.get("last_scheduled")
        self.peak = None if peak is None else float(peak)
        self.hold_jumps = bool(state.get("hold_jumps", False))
        self.holding = bool(state.get("holding", False))
        self._last_scheduled = None if last is None else float(last)
        base = state.get("jump_base")
        self.jump_base = None if base is None else float(base)


def _assign(group: dict, lr: float) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"] = group["lr"].clone().fill_(lr)
    else:
        group["lr"] = lr


def _positive(value: float, name: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
