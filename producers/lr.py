"""The learning rate as the guard changes it, on top of the user's schedule.

The guard never writes its changes into the optimizer for good: it keeps a
``scale`` and applies it around ``optimizer.step()`` only (set, step, put
back). A scheduler therefore keeps reading and writing the LR it scheduled,
never compounding the guard's factor, and every param group is scaled alike.
``restore`` raises the scale back towards 1, and never lets any group's
effective LR exceed its base LR as the guard found it at start (the
scheduler's ``base_lrs`` when there is a scheduler, else the group's LR).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch


class LRControl:
    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        self.optimizer = optimizer
        # A scheduler's base_lrs are the LRs the schedule is relative to (a warm-up
        # starts far below them); without one, the LRs the guard found at start.
        base = getattr(scheduler, "base_lrs", None)
        self.base = [float(b) for b in base] if base else [float(g["lr"]) for g in optimizer.param_groups]
        self.scale = 1.0

    def scheduled(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def effective(self) -> float:
        """Group 0's LR as the next update will use it."""
        return float(self.optimizer.param_groups[0]["lr"]) * self.scale

    def _cap(self) -> float:
        caps = [b / s for b, s in zip(self.base, self.scheduled()) if s > 0]
        return min(caps) if caps else 1.0

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
        self.scale = min(self.scale * factor, 1.0, self._cap())
        return self.effective()

    def step(self, optimizer_step: Callable[[], Any]) -> Any:
        """Run ``optimizer_step`` with the guard's scale applied to every group."""
        if self.scale == 1.0:
            return optimizer_step()
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g, lr in zip(groups, saved):
            _assign(g, lr * self.scale if not isinstance(lr, torch.Tensor) else lr.item() * self.scale)
        try:
            return optimizer_step()
        finally:
            for g, lr in zip(groups, saved):
                g["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "base": list(self.base)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state.get("scale", 1.0))
        if state.get("base"):
            self.base = [float(b) for b in state["base"]]


def _assign(group: dict, lr: float) -> None:
    if isinstance(group["lr"], torch.Tensor):
        group["lr"] = group["lr"].clone().fill_(lr)
    else:
        group["lr"] = lr


def _positive(value: float, name: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
