"""The recovery benchmark's faults, keyed by global batch index or step so every strategy meets the same ones.

==============  ==================================================================
``bad_shard``    ``shard_batches`` consecutive batches whose targets are shuffled
                 across the batch (the text no longer predicts them): a moderate
                 loss spike, and the same batches come again after a rollback.
``lr_blowup``    LR x``lr_factor`` for ``lr_steps`` steps, inside the schedule
                 (see :func:`recovery_setup.schedule`): a rollback replays it.
``instability``  the whole run at LR x``unstable_lr_factor``; nothing injected.
``nan_batch``    one batch whose loss is NaN.
``overflow``     fp16-style training under ``GradScaler("cpu")``: every gradient
                 goes through float16 (values past 65504 become inf, tiny ones
                 flush to zero), and ``overflow_batches`` consecutive batches
                 overflow (an inf in one gradient). Each overflow halves the
                 loss scale; after the burst the scale is so small that the
                 fp16 gradients underflow to zero and the run stops learning,
                 while the scaler takes 2000 clean steps to double it once.
==============  ==================================================================

Why the overflow fault looks like this: a GradScaler alone survives isolated
overflows by design (skip, halve, carry on), so injecting a few would test
nothing. A burst collapses the scale, the failure fp16 runs actually die of.
"""

from __future__ import annotations

import torch

from recovery_setup import BenchConfig

FAULTS = ("bad_shard", "lr_blowup", "instability", "nan_batch", "overflow")
FP16_MAX_SCALE = 2.0 ** 16


class Fault:
    def __init__(self, name: str, cfg: BenchConfig, seed: int) -> None:
        if name not in FAULTS + ("clean",):
            raise ValueError(f"unknown fault {name!r}; choose from {', '.join(FAULTS)}")
        self.name, self.cfg, self.seed = name, cfg, seed
        self.first = cfg.fault_step

    @property
    def uses_scaler(self) -> bool:
        return self.name == "overflow"

    def make_scaler(self) -> torch.amp.GradScaler | None:
        if not self.uses_scaler:
            return None
        return torch.amp.GradScaler("cpu", init_scale=FP16_MAX_SCALE, growth_interval=2000)

    def _in(self, index: int | None, length: int) -> bool:
        return index is not None and self.first <= index < self.first + length

    def batch(self, index: int | None, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch as the faulty run sees it."""
        if self.name == "bad_shard" and self._in(index, self.cfg.shard_batches):
            gen = torch.Generator().manual_seed(self.seed * 100_003 + int(index))
            flat = y.reshape(-1)
            y = flat[torch.randperm(flat.numel(), generator=gen)].reshape(y.shape)
        return x, y

    def loss(self, index: int | None, loss: torch.Tensor) -> torch.Tensor:
        if self.name == "nan_batch" and index == self.first:
            return loss * float("nan")
        return loss

    def grads(self, index: int | None, model: torch.nn.Module) -> None:
        """After backward, before anything reads the gradients: the fp16 round trip and the overflow."""
        if not self.uses_scaler:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for g in grads:
            g.copy_(g.half().float())
        if self._in(index, self.cfg.overflow_batches) and grads:
            grads[0].view(-1)[0] = float("inf")
