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
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch


class LRControl:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.scale = 1.0  # the guard's factor on top of the schedule; 1 = the schedule as it is

    def scheduled(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def effective(self) -> float:
        """Group 0's LR as the next update will use it."""
        return float(self.optimizer.param_groups[0]["lr"]) * self.scale

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
        if self.scale == 1.0:
            return None
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g, lr in zip(groups, saved):
            _assign(
                g, lr * self.scale if not isinstance(lr, torch.Tensor) else lr.item() * self.scale
            )
        return saved

    def put_back(self, saved: list[Any] | None) -> None:
        """The scheduled values back: the scheduler steps from its own value, never the scaled one."""
        if saved is not None:
            for g, lr in zip(self.optimizer.param_groups, saved):
                g["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state.get("scale", 1.0))


def _assign(group: dict, lr: float) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"] = group["lr"].clone().fill_(lr)
    else:
        group["lr"] = lr


def _positive(value: float, name: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
