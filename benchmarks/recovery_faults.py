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
``healthy``      nothing injected, on a noisy run: ``noise_fraction`` of every
                 batch's targets are random characters from the first step on.
                 The best response is none.
``data_shift``   a benign, permanent shift: from ``fault_step`` on, ``shift_fraction``
                 of every batch's targets are random (harder data, not bad data).
                 The loss steps up and stays; rolling back cannot help.
``transient``    one device fault: the first computation of batch ``fault_step``
                 gets its gradients multiplied by ``transient_scale``; a re-run of
                 the same batch is clean (``Fault.reset_transient`` is not needed:
                 a batch is struck once per run).
``slow_rise``    a mis-set schedule that creeps: from ``fault_step`` the LR grows
                 linearly to x``slow_lr_factor`` over ``slow_steps`` steps and stays
                 there for ``slow_steps`` more (see :func:`recovery_setup.schedule`).
==============  ==================================================================

Why the overflow fault looks like this: a GradScaler alone survives isolated
overflows by design (skip, halve, carry on), so injecting a few would test
nothing. A burst collapses the scale, the failure fp16 runs actually die of.
"""

from __future__ import annotations

import torch

from recovery_setup import BenchConfig

FAULTS = (
    "bad_shard",
    "lr_blowup",
    "instability",
    "nan_batch",
    "overflow",
    "healthy",
    "data_shift",
    "transient",
    "slow_rise",
)
FP16_MAX_SCALE = 2.0**16


class Fault:
    def __init__(self, name: str, cfg: BenchConfig, seed: int) -> None:
        if name not in FAULTS + ("clean",):
            raise ValueError(f"unknown fault {name!r}; choose from {', '.join(FAULTS)}")
        self.name, self.cfg, self.seed = name, cfg, seed
        self.first = cfg.fault_step
        self.struck: set[int] = set()  # transient: batches already corrupted once

    @property
    def uses_scaler(self) -> bool:
        return self.name == "overflow"

    def make_scaler(self) -> torch.amp.GradScaler | None:
        if not self.uses_scaler:
            return None
        return torch.amp.GradScaler(
            self.cfg.device, init_scale=FP16_MAX_SCALE, growth_interval=2000
        )

    def _in(self, index: int | None, length: int) -> bool:
        return index is not None and self.first <= index < self.first + length

    def batch(
        self, index: int | None, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch as the faulty run sees it."""
        if self.name == "bad_shard" and self._in(index, self.cfg.shard_batches):
            assert index is not None  # _in is false without one
            gen = torch.Generator().manual_seed(self.seed * 100_003 + int(index))
            flat = y.reshape(-1)
            y = flat[torch.randperm(flat.numel(), generator=gen)].reshape(y.shape)
        noise = (
            self.cfg.noise_fraction
            if self.name == "healthy"
            else self.cfg.shift_fraction
            if self.name == "data_shift" and index is not None and index >= self.first
            else 0.0
        )
        if noise > 0.0 and index is not None:
            gen = torch.Generator().manual_seed(self.seed * 100_019 + int(index))
            hit = torch.rand(y.shape, generator=gen) < noise
            y = torch.where(hit, torch.randint(0, int(y.max()) + 1, y.shape, generator=gen), y)
        return x, y

    def loss(self, index: int | None, loss: torch.Tensor) -> torch.Tensor:
        if self.name == "nan_batch" and index == self.first:
            return loss * float("nan")
        return loss

    def grads(self, index: int | None, model: torch.nn.Module) -> None:
        """After backward, before anything reads the gradients: the fp16 round trip and the overflow,
        or the transient device fault (the batch's first computation only)."""
        if self.name == "transient" and index == self.first and index not in self.struck:
            self.struck.add(index)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.cfg.transient_scale)
        if not self.uses_scaler:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for g in grads:
            g.copy_(g.half().float())
        if self._in(index, self.cfg.overflow_batches) and grads:
            grads[0].view(-1)[0] = float("inf")
