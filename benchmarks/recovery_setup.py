"""The recovery benchmark's training problem: a small character-level GPT on stdlib text.

Everything a run needs is built from ``(seed, BenchConfig)`` alone, so every
strategy of a fault starts from the same weights and sees the same batches in
the same order (the order comes from spikeguard's GuardedLoader, seeded by
``seed``, for the guarded and the unguarded loops alike).

The text is the source of a few standard-library modules: it ships with
Python, so nothing is downloaded, and it is code, so a character model has
structure to learn in a few hundred steps.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import math
import random
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

SOURCES = (argparse, collections, dataclasses, enum, typing)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark configuration; ``quick`` and ``full`` below are the two presets."""

    steps: int = 800
    batch_size: int = 16
    block: int = 64  # characters of context
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    warmup: int = 30
    eval_windows: int = 128
    checkpoint_every: int = 20  # the same cadence for every strategy that checkpoints
    fault_step: int = 300  # where (step / global batch index) the injected faults start
    shard_batches: int = 40  # bad_shard: this many consecutive corrupted batches
    lr_factor: float = 20.0  # lr_blowup: LR x this ...
    lr_steps: int = 50  # ... for this many steps
    unstable_lr_factor: float = 25.0  # instability: the whole run at LR x this, nothing injected
    overflow_batches: int = 40  # overflow: this many consecutive overflowing gradients
    palm_back: int = 100  # palm_manual: restart at least this many steps before the spike ...
    palm_skip: int = 200  # ... and skip this many batches from there
    max_restarts: int = 20  # lightning_spike gives up restarting after this many ...
    palm_max_restarts: int = (
        3  # ... palm_manual (each of its restarts costs hundreds of steps) after this many
    )
    noise_fraction: float = 0.1  # healthy: this share of every batch's targets is random
    shift_fraction: float = 0.15  # data_shift: this share from fault_step on
    transient_scale: float = 1000.0  # transient: the struck batch's gradients x this, once
    slow_lr_factor: float = 8.0  # slow_rise: the LR creeps up to x this ...
    slow_steps: int = 60  # ... over this many steps, and stays for as many more
    device: str = "cpu"


# Quick: 9 faults x 6 strategies x 5 seeds + 5 clean = 275 runs of a 2-layer, 48-wide model:
# the smallest at which every fault still harms an unguarded run. The faults land at step 320,
# after the detectors have settled (the outlier models' tails hold settle=300 residuals by
# step ~310; before that one point must be x1.5 and the climb test is off, so that a healthy
# warm-up is left alone): a data spike in a run's first 300 steps is rare, and a warm-up
# looks like one. 80 steps after the fault show what each response left.
QUICK = BenchConfig(
    steps=400,
    block=32,
    d_model=48,
    eval_windows=96,
    fault_step=320,
    shard_batches=20,
    lr_steps=30,
    overflow_batches=20,
    palm_back=40,
    palm_skip=60,
    slow_steps=30,
)
FULL = BenchConfig()
TINY = BenchConfig(
    steps=90,
    d_model=32,
    layers=1,
    heads=2,
    block=32,
    warmup=10,
    eval_windows=32,
    checkpoint_every=10,
    fault_step=45,
    shard_batches=8,
    lr_steps=10,
    overflow_batches=8,
    palm_back=20,
    palm_skip=30,
    slow_steps=10,
)
# ~50M parameters (12 * 512^2 * 16 in the blocks), for a GPU: ``--device cuda``.
CUDA = BenchConfig(
    steps=3000,
    batch_size=32,
    block=256,
    d_model=512,
    layers=16,
    heads=8,
    lr=6e-4,
    warmup=200,
    eval_windows=256,
    checkpoint_every=100,
    fault_step=1200,
    shard_batches=100,
    lr_steps=150,
    overflow_batches=100,
    palm_back=100,
    palm_skip=300,
    slow_steps=150,
    device="cuda",
)


def corpus() -> str:
    # Each of SOURCES is a standard-library module loaded from a .py file: it has a __file__.
    text = "\n".join(
        Path(typing.cast(str, m.__file__)).read_text(encoding="utf-8") for m in SOURCES
    )
    return "".join(c if 32 <= ord(c) < 127 or c == "\n" else " " for c in text)


class Windows(Dataset):
    """Window ``i`` is characters ``[i*stride, i*stride + block + 1)``: input and shifted target."""

    def __init__(self, ids: torch.Tensor, block: int) -> None:
        self.ids, self.block, self.stride = ids, block, block // 2

    def __len__(self) -> int:
        return (len(self.ids) - self.block - 1) // self.stride

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.stride : i * self.stride + self.block + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """Pre-LN attention + MLP, no QK normalisation: attention logits are free to grow."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, cfg: BenchConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.block, cfg.d_model))
        self.blocks = nn.Sequential(*(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers)))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        return self.head(self.ln(self.blocks(h)))


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    device = next(model.parameters()).device
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@dataclass
class Problem:
    model: TinyGPT
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loader: DataLoader
    eval_x: torch.Tensor
    eval_y: torch.Tensor
    vocab: int


def schedule(cfg: BenchConfig, blowup: str | None) -> typing.Callable[[int], float]:
    """Warm-up then cosine to 10 %; ``blowup`` ("lr_blowup" or "slow_rise") adds that fault's
    mis-set window (x``lr_factor`` at once, or a creep to x``slow_lr_factor``).

    The window lives in the schedule (keyed by step), not in the data: a
    rollback that restores the scheduler walks into it again, as a mis-set
    schedule would.
    """

    def factor(step: int) -> float:
        base = (
            (step + 1) / cfg.warmup
            if step < cfg.warmup
            else 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / cfg.steps)))
        )
        if blowup == "lr_blowup" and cfg.fault_step <= step < cfg.fault_step + cfg.lr_steps:
            return base * cfg.lr_factor
        if blowup == "slow_rise" and cfg.fault_step <= step < cfg.fault_step + 2 * cfg.slow_steps:
            ramp = min(1.0, (step - cfg.fault_step + 1) / cfg.slow_steps)
            return base * (1.0 + (cfg.slow_lr_factor - 1.0) * ramp)
        return base

    return factor


def build(seed: int, cfg: BenchConfig, fault: str) -> Problem:
    torch.manual_seed(seed)
    random.seed(seed)
    text = corpus()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(len(ids) * 0.9)
    train, held = Windows(ids[:split], cfg.block), Windows(ids[split:], cfg.block)
    pick = torch.randperm(len(held), generator=torch.Generator().manual_seed(1234))[
        : cfg.eval_windows
    ]
    eval_x = torch.stack([held[int(i)][0] for i in pick]).to(cfg.device)
    eval_y = torch.stack([held[int(i)][1] for i in pick]).to(cfg.device)
    model = TinyGPT(len(chars), cfg).to(cfg.device)
    lr = cfg.lr * (cfg.unstable_lr_factor if fault == "instability" else 1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, schedule(cfg, fault if fault in ("lr_blowup", "slow_rise") else None)
    )
    loader = DataLoader(train, batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    return Problem(model, optimizer, scheduler, loader, eval_x, eval_y, len(chars))


def evaluate(problem: Problem) -> float:
    with torch.no_grad():
        return float(lm_loss(problem.model, problem.eval_x, problem.eval_y))
