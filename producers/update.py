"""The optimizer update a guarded step lets through or voids, whoever calls ``optimizer.step()``.

A voided update sets every gradient to ``None``, which torch optimizers treat
as "this parameter takes no step": no moment update, no weight decay, no step
count (zeroed gradients would still move AdamW). That holds whether the Guard
steps the optimizer itself (``Guard.step``) or a framework does after the
Guard's first half (``before_update``).
"""

from __future__ import annotations

from typing import Any

import torch


def torch_optimizer(optimizer: Any, required: bool = True) -> Any:
    """The torch optimizer inside a framework's wrapper (accelerate's ``.optimizer``, Lightning's).

    Without one: TypeError, or ``optimizer`` itself when not ``required``.
    """
    inner = optimizer
    # (accelerate's AcceleratedOptimizer is an Optimizer subclass around the real one)
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer) or (
        not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer")
    ):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        if not required:
            return optimizer
        raise TypeError(f"no torch optimizer found in {type(optimizer).__name__}")
    return inner


def void_update(optimizer: Any) -> None:
    """Make the coming ``optimizer.step()`` change nothing: every gradient is None."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
