"""Real torch runs with per-layer gradient norms: healthy, and with a layer-local blow-up injected.

The simulator and the real loss logs carry no per-layer norms, so the ``ml``
detector's layer view is evaluated on small real models trained here, on the
CPU, in a few seconds, with the Guard's own statistics
(:class:`~spikeguard.producers.stats.GradStats`: total norm and top-k layers).

The injected fault is a layer blow-up the total norm hides: at ``inject_at``
one layer's weight and bias are divided by ``factor``. A LayerNorm follows the
layer, so the forward pass (and the loss) hardly changes, but the layer's
gradient grows ``factor`` times (a scale-invariant function's gradient scales
as 1/scale) and its relative update as much: the layer-local precursor of an
instability, while the total norm moves < 2x. The label covers ``label_steps``
steps from the injection, kind ``layer_blowup``.

Same arguments, same events (torch is seeded and pinned to one thread here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from spikeguard.lab.runfile import StepLabel
from spikeguard.producers.stats import GradStats
from spikeguard.schemas import StepEvent

KIND = "layer_blowup"


@dataclass(frozen=True)
class LayerRun:
    name: str
    events: list[StepEvent]
    labels: list[StepLabel]
    layer: str | None  # the injected layer's weight, or None for a healthy run


class _Blocks(torch.nn.Module):
    """Linear -> LayerNorm -> GELU blocks and a linear head: each block is scale-invariant."""

    def __init__(self, inputs: int, width: int, depth: int, outputs: int) -> None:
        super().__init__()
        sizes = [inputs] + [width] * depth
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.LayerNorm(b), torch.nn.GELU())
            for a, b in zip(sizes, sizes[1:], strict=False)
        )
        self.head = torch.nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _lr(step: int, steps: int, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine to 10 %: a usual pre-training schedule."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return base * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def layer_run(
    seed: int = 0,
    steps: int = 800,
    *,
    task: str = "regression",
    optimizer: str = "adam",
    inject_at: int | None = None,
    block: int = 3,
    factor: float = 6.0,
    label_steps: int = 10,
    depth: int = 5,
    width: int = 32,
    top_k: int = 5,
) -> LayerRun:
    """One run of a small real model; ``inject_at`` shrinks block ``block``'s linear layer there.

    The defaults (block 3 of 5, factor 6) take that layer from ~4-7 % of the squared
    gradient norm to 45-78 % while the total norm moves x1.0-x3.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(
            seed, steps, task, optimizer, inject_at, block, factor, label_steps, depth, width, top_k
        )
    finally:
        torch.set_num_threads(threads)


def _train(
    seed, steps, task, optimizer, inject_at, block, factor, label_steps, depth, width, top_k
) -> LayerRun:
    if task not in ("regression", "classification"):
        raise ValueError(f"task must be 'regression' or 'classification', not {task!r}")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    inputs = 16
    batch = 128 if task == "classification" else 32  # a calmer cross-entropy: a healthy run
    outputs = 4 if task == "classification" else 1
    model = _Blocks(inputs, width, depth, outputs)
    teacher = torch.randn(inputs, outputs, generator=gen)
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=1e-3, weight_decay=0.01
        )
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    else:
        raise ValueError(f"optimizer must be 'adam' or 'sgd', not {optimizer!r}")
    base = opt.param_groups[0]["lr"]
    stats = GradStats(list(model.named_parameters()), top_k=top_k)
    target = model.blocks[block][0]
    name = f"{'sgd' if optimizer == 'sgd' else 'adam'}-{task}-s{seed}" + (
        f"-blowup{inject_at}" if inject_at is not None else ""
    )
    events, labels = [], []
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    for step in range(steps):
        lr = _lr(step, steps, base, warmup=steps // 20)
        for group in opt.param_groups:
            group["lr"] = lr
        x = torch.randn(batch, inputs, generator=gen)
        if task == "classification":
            y = (x @ teacher).argmax(dim=1)
            loss_fn = torch.nn.functional.cross_entropy
        else:
            y = torch.tanh(x @ teacher) + 0.1 * torch.randn(batch, 1, generator=gen)
            loss_fn = torch.nn.functional.mse_loss
        if step == inject_at:
            with torch.no_grad():
                target.weight.div_(factor)
                target.bias.div_(factor)
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        s, _ = stats.compute(loss)
        opt.step()
        events.append(
            StepEvent(
                run_id=name,
                step=step,
                time=float(step),
                loss=s.loss,
                grad_norm=s.grad_norm,
                lr=lr,
                top_grad_norms=s.top_grad_norms,
            )
        )
        hit = inject_at is not None and inject_at <= step < inject_at + label_steps
        labels.append(StepLabel(hit, KIND if hit else ""))
    layer = None if inject_at is None else f"blocks.{block}.0.weight"
    return LayerRun(name, events, labels, layer)


def layer_set(seeds: tuple[int, ...] = (0, 1, 2), steps: int = 800) -> list[tuple[str, LayerRun]]:
    """The evaluation set: per seed and optimizer, a healthy run and its twin with a blow-up.

    Regression only: on the small classification task the cross-entropy of a
    128-row batch jumps 1.5x between batches late in training, and the
    statistical detector calls those loss spikes; that is its own question.
    """
    out = []
    for seed in seeds:
        for task, optimizer in (("regression", "adam"), ("regression", "sgd")):
            out.append(("layer-healthy", layer_run(seed, steps, task=task, optimizer=optimizer)))
            out.append(
                (
                    "layer-blowup",
                    layer_run(
                        seed,
                        steps,
                        task=task,
                        optimizer=optimizer,
                        inject_at=steps // 2 + 37 * seed,
                    ),
                )
            )
    return out
