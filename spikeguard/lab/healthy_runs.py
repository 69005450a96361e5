"""Healthy training runs of the kinds users really have, trained for real and recorded.

A guard that acts on a healthy run is worse than none, and healthy loss
curves differ a lot: a batch-1 regression's loss is chi-square noise around a
floor, a classifier with label noise has a long tail, an LR decay drops the
loss for good, a warm restart raises it on purpose. Each :class:`HealthyKind`
builds a small real torch task (model, optimizer, scheduler, data), seeded,
so the same kind can be recorded to a CSV here and trained under the live
Guard in a test.

    python -m spikeguard.lab.healthy_runs --out data/healthy

writes one ``<kind>.csv`` per kind (``step,loss,grad_norm,lr``: the loss of
the step's batch, the gradient's L2 norm before the update, the LR the update
used) and a ``SOURCES.md`` saying how they were made. Nothing is injected:
every action a guard takes on them is a false one.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

DEFAULT_STEPS = 5000
DEFAULT_SEED = 0


class HealthyTask(NamedTuple):
    """One kind's training, ready to run: ``loss(batch)`` is the step's loss, before backward."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    loader: DataLoader
    loss: Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class HealthyKind:
    name: str
    description: str
    build: Callable[[int, int], HealthyTask]  # (seed, steps) -> the task


def _loader(dataset: TensorDataset, batch: int, seed: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(seed),
    )


def _regression_data(seed: int, n: int = 4096, dim: int = 8, noise: float = 0.5) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    return TensorDataset(x, x @ w + noise * torch.randn(n, 1, generator=g))


def _noisy_blobs(
    seed: int, n: int = 8192, dim: int = 16, classes: int = 4, label_noise: float = 0.2
) -> TensorDataset:
    """Overlapping Gaussian classes; a ``label_noise`` share of labels drawn at random."""
    g = torch.Generator().manual_seed(seed)
    centres = 1.5 * torch.randn(classes, dim, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    x = centres[y] + torch.randn(n, dim, generator=g)
    flip = torch.rand(n, generator=g) < label_noise
    y = torch.where(flip, torch.randint(0, classes, (n,), generator=g), y)
    return TensorDataset(x, y)


def _teacher_data(seed: int, n: int = 16384, dim: int = 32, classes: int = 10) -> TensorDataset:
    """Labels of a random teacher network: learnable, but slowly (the loss keeps falling)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w1 = torch.randn(dim, 64, generator=g) / math.sqrt(dim)
    w2 = torch.randn(64, classes, generator=g) / 8.0
    return TensorDataset(x, (torch.tanh(x @ w1) @ w2 * 4).argmax(dim=1))


def _mlp(*widths: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _mse(model: nn.Module) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    return lambda batch: nn.functional.mse_loss(model(batch[0]), batch[1])


def _cross_entropy(model: nn.Module) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    return lambda batch: nn.functional.cross_entropy(model(batch[0]), batch[1])


def regression(batch: int, lr: float) -> Callable[[int, int], HealthyTask]:
    """Linear regression with SGD: the loss falls to its noise floor and stays there."""

    def build(seed: int, steps: int) -> HealthyTask:
        torch.manual_seed(seed)
        model = nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        loader = _loader(_regression_data(seed), batch, seed)
        return HealthyTask(model, optimizer, None, loader, _mse(model))

    return build


def noisy_classification(batch: int) -> Callable[[int, int], HealthyTask]:
    """An MLP on overlapping classes with 20 % random labels, Adam: a heavy-tailed loss."""

    def build(seed: int, steps: int) -> HealthyTask:
        torch.manual_seed(seed)
        model = _mlp(16, 64, 4)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        return HealthyTask(
            model, optimizer, None, _loader(_noisy_blobs(seed), batch, seed), _cross_entropy(model)
        )

    return build


def _teacher_task(
    seed: int, lr: float, batch: int = 16
) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    torch.manual_seed(seed)
    model = _mlp(32, 128, 128, 10)
    return (
        model,
        torch.optim.Adam(model.parameters(), lr=lr),
        _loader(_teacher_data(seed), batch, seed),
    )


def falling(seed: int, steps: int) -> HealthyTask:
    """A slow learner at a small constant LR: the loss falls through the whole run."""
    model, optimizer, loader = _teacher_task(seed, lr=1e-4, batch=32)
    return HealthyTask(model, optimizer, None, loader, _cross_entropy(model))


def lr_drop(seed: int, steps: int) -> HealthyTask:
    """The LR divided by 10 half-way: the loss drops to a lower level for good (benign)."""
    torch.manual_seed(seed)
    model = _mlp(16, 64, 4)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, steps // 2), gamma=0.1)
    loader = _loader(_noisy_blobs(seed), 16, seed)
    return HealthyTask(model, optimizer, scheduler, loader, _cross_entropy(model))


def warm_restarts(seed: int, steps: int) -> HealthyTask:
    """Cosine annealing with warm restarts: at each restart the LR jumps back up, the loss with it."""
    model, optimizer, loader = _teacher_task(seed, lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        optimizer, T_0=max(1, steps // 7), T_mult=2
    )
    return HealthyTask(model, optimizer, scheduler, loader, _cross_entropy(model))


def warmup(seed: int, steps: int) -> HealthyTask:
    """A linear LR warm-up over the first fifth, then cosine decay: the usual LM schedule."""
    model, optimizer, loader = _teacher_task(seed, lr=3e-3)
    ramp = max(1, steps // 5)

    def factor(step: int) -> float:
        if step < ramp:
            return (step + 1) / ramp
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - ramp) / max(1, steps - ramp))))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return HealthyTask(model, optimizer, scheduler, loader, _cross_entropy(model))


def heavy_tailed_regression(seed: int, steps: int) -> HealthyTask:
    """Linear regression on targets with Student-t noise (2.5 degrees of freedom), batch 1, SGD:
    a squared error's tail so heavy that one batch in thousands is x1000 its median."""
    g = torch.Generator().manual_seed(seed)
    n, dim = 8192, 8
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g)
    noise = torch.from_numpy(np.random.default_rng(seed).standard_t(2.5, (n, 1))).float()
    torch.manual_seed(seed)
    model = nn.Linear(dim, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005)
    loader = _loader(TensorDataset(x, x @ w + noise), 1, seed)
    return HealthyTask(model, optimizer, None, loader, _mse(model))


def near_zero_cnn(seed: int, steps: int) -> HealthyTask:
    """A small CNN on striped 16x16 images, batch 8, SGD with momentum, LR x0.1 at 30 %: the loss
    falls towards 1e-4, and a hard batch now and then is x1000 that."""
    g = torch.Generator().manual_seed(seed)
    n = 6000
    rows, cols = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    patterns = torch.stack(
        [
            torch.sin(rows * math.pi / 2),
            torch.sin(cols * math.pi / 2),
            torch.sin((rows + cols) * math.pi / 4),
        ]
    )
    y = torch.randint(0, 3, (n,), generator=g)
    strength = 0.3 + 0.4 * torch.rand(n, 1, 1, generator=g)
    x = (strength * patterns[y] + torch.randn(n, 16, 16, generator=g)).unsqueeze(1)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 3),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(
        optimizer, step_size=max(1, 3 * steps // 10), gamma=0.1
    )
    loader = _loader(TensorDataset(x, y), 8, seed)
    return HealthyTask(model, optimizer, scheduler, loader, _cross_entropy(model))


def poisson_regression(seed: int, steps: int) -> HealthyTask:
    """Poisson regression of counts (rates 1 to 50) on the log-rate, batch 4, Adam: the loss
    (``exp(eta) - y * eta``, PyTorch's default without the constant) falls through zero and
    settles below it."""
    g = torch.Generator().manual_seed(seed)
    n, dim = 8192, 8
    x = torch.randn(n, dim, generator=g)
    w = 0.4 * torch.randn(dim, 1, generator=g)
    rate = torch.exp(2.0 + x @ w).clamp(1.0, 50.0)
    counts = torch.poisson(rate, generator=g)
    torch.manual_seed(seed)
    model = nn.Linear(dim, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_fn = nn.PoissonNLLLoss(log_input=True)
    loader = _loader(TensorDataset(x, counts), 4, seed)
    return HealthyTask(model, optimizer, None, loader, lambda b: loss_fn(model(b[0]), b[1]))


class MeanAndVariance(nn.Module):
    """An MLP that predicts a mean and a variance (heteroscedastic regression)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.body = _mlp(dim, 32, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_var = self.body(x).unbind(dim=1)
        return mean, log_var.exp()


def gaussian_nll(seed: int, steps: int) -> HealthyTask:
    """Heteroscedastic regression (noise 0.05 to 0.5, by input) with a Gaussian NLL, batch 8,
    Adam: the loss falls from about 1 to well below zero, its hard batches a few units up."""
    g = torch.Generator().manual_seed(seed)
    n, dim = 8192, 4
    x = torch.randn(n, dim, generator=g)
    scale = 0.05 + 0.45 * torch.sigmoid(2 * x[:, 0])
    y = torch.sin(x[:, 1]) + x[:, 2] + scale * torch.randn(n, generator=g)
    torch.manual_seed(seed)
    model = MeanAndVariance(dim)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loss_fn = nn.GaussianNLLLoss()

    def loss(b: list[torch.Tensor]) -> torch.Tensor:
        mean, var = model(b[0])
        return loss_fn(mean, b[1], var)

    return HealthyTask(model, optimizer, None, _loader(TensorDataset(x, y), 8, seed), loss)


def multi_margin(seed: int, steps: int) -> HealthyTask:
    """An MLP on well-separated classes with a multi-class hinge loss, batch 8, SGD: once learnt,
    the loss (and the gradient) is exactly zero on ~95 % of the batches."""
    g = torch.Generator().manual_seed(seed)
    n = 8192
    centres = 3.0 * torch.randn(4, 16, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    x = centres[y] + torch.randn(n, 16, generator=g)
    torch.manual_seed(seed)
    model = _mlp(16, 32, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MultiMarginLoss()
    loader = _loader(TensorDataset(x, y), 8, seed)
    return HealthyTask(model, optimizer, None, loader, lambda b: loss_fn(model(b[0]), b[1]))


_SUBJECTS = (
    "the cat",
    "a dog",
    "my friend",
    "the old man",
    "our teacher",
    "a small bird",
    "the river",
)
_VERBS = ("sees", "likes", "follows", "finds", "carries", "watches", "hears")
_OBJECTS = (
    "the ball",
    "a red box",
    "the moon",
    "some bread",
    "the green door",
    "a long road",
    "the sea",
)
_ENDINGS = (".", " today.", " again.", " at night.", " in the rain.")


def made_up_text(seed: int, sentences: int = 6000) -> str:
    """Simple English-like sentences from a tiny grammar: text for a char-LM, made here, not shipped."""
    g = torch.Generator().manual_seed(seed)

    def pick(words: tuple[str, ...]) -> str:
        return words[int(torch.randint(0, len(words), (1,), generator=g))]

    return " ".join(
        f"{pick(_SUBJECTS)} {pick(_VERBS)} {pick(_OBJECTS)}{pick(_ENDINGS)}"
        for _ in range(sentences)
    )


class CharGRU(nn.Module):
    def __init__(self, vocab: int, embed: int = 24, hidden: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(self.embed(ids))
        return self.head(out)


def char_lm(seed: int, steps: int, context: int = 32, batch: int = 16) -> HealthyTask:
    """A one-layer character GRU on made-up text, AdamW: a small language model's loss."""
    text = made_up_text(seed)
    alphabet = {c: i for i, c in enumerate(sorted(set(text)))}
    ids = torch.tensor([alphabet[c] for c in text])
    starts = torch.arange(0, len(ids) - context - 1, context // 2)
    windows = ids[starts[:, None] + torch.arange(context + 1)]
    torch.manual_seed(seed)
    model = CharGRU(len(alphabet))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    vocab = len(alphabet)

    def loss(b: list[torch.Tensor]) -> torch.Tensor:
        (w,) = b
        return nn.functional.cross_entropy(
            model(w[:, :-1]).reshape(-1, vocab), w[:, 1:].reshape(-1)
        )

    return HealthyTask(model, optimizer, None, _loader(TensorDataset(windows), batch, seed), loss)


KINDS: dict[str, HealthyKind] = {
    k.name: k
    for k in (
        HealthyKind(
            "regression_b1",
            "linear regression, batch 1, SGD 0.01 (stationary loss)",
            regression(1, 0.01),
        ),
        HealthyKind(
            "regression_b4",
            "linear regression, batch 4, SGD 0.02 (stationary loss)",
            regression(4, 0.02),
        ),
        HealthyKind(
            "regression_b32",
            "linear regression, batch 32, SGD 0.05 (stationary loss)",
            regression(32, 0.05),
        ),
        HealthyKind(
            "classification_noisy_b1",
            "MLP, 4 classes, 20% label noise, batch 1, Adam 1e-3",
            noisy_classification(1),
        ),
        HealthyKind(
            "classification_noisy_b4",
            "MLP, 4 classes, 20% label noise, batch 4, Adam 1e-3",
            noisy_classification(4),
        ),
        HealthyKind(
            "classification_noisy_b32",
            "MLP, 4 classes, 20% label noise, batch 32, Adam 1e-3",
            noisy_classification(32),
        ),
        HealthyKind(
            "falling",
            "MLP on a teacher's labels, batch 32, Adam 1e-4: the loss falls all run",
            falling,
        ),
        HealthyKind(
            "lr_drop",
            "noisy classification, batch 16, Adam 1e-2 then 1e-3 half-way (benign drop)",
            lr_drop,
        ),
        HealthyKind(
            "warm_restarts",
            "teacher MLP, batch 16, Adam 3e-3, cosine with warm restarts (T_0 = steps/7, x2)",
            warm_restarts,
        ),
        HealthyKind(
            "warmup",
            "teacher MLP, batch 16, Adam 3e-3, linear warm-up over steps/5 then cosine",
            warmup,
        ),
        HealthyKind(
            "regression_heavy_b1",
            "linear regression, Student-t (2.5 dof) target noise, batch 1, SGD 0.005",
            heavy_tailed_regression,
        ),
        HealthyKind(
            "near_zero_cnn",
            "small CNN on striped images, batch 8, SGD 0.01 momentum 0.9, x0.1 at 30 %: "
            "the loss falls towards 1e-4 with hard batches",
            near_zero_cnn,
        ),
        HealthyKind(
            "poisson_b4",
            "Poisson regression of counts, log-rate input, batch 4, Adam 0.01: "
            "the loss falls through zero and stays below it",
            poisson_regression,
        ),
        HealthyKind(
            "gaussian_nll",
            "MLP predicting mean and variance, Gaussian NLL, batch 8, Adam 3e-3: "
            "the loss falls from ~1 to well below zero",
            gaussian_nll,
        ),
        HealthyKind(
            "hinge_b8",
            "MLP, multi-class hinge loss, batch 8, SGD 0.01: the loss is zero on most batches",
            multi_margin,
        ),
        HealthyKind(
            "char_lm",
            "character GRU (64 units) on made-up sentences, batch 16 x 32, AdamW 3e-3",
            char_lm,
        ),
    )
}


class StepRecord(NamedTuple):
    step: int
    loss: float
    grad_norm: float
    lr: float


def grad_norm(model: nn.Module) -> float:
    """The L2 norm of all gradients together (what the Guard measures, before any clipping)."""
    norms = [p.grad.detach().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def batches(loader: DataLoader, steps: int):
    """``steps`` batches, epoch after epoch."""
    served = 0
    while served < steps:
        for batch in loader:
            yield batch
            served += 1
            if served == steps:
                return


def record(kind: str, steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED) -> list[StepRecord]:
    """Train ``kind`` for ``steps`` plain steps (no guard), recording each one."""
    task = KINDS[kind].build(seed, steps)
    rows = []
    for step, batch in enumerate(batches(task.loader, steps)):
        task.optimizer.zero_grad(set_to_none=True)
        loss = task.loss(batch)
        loss.backward()
        lr = task.optimizer.param_groups[0]["lr"]
        rows.append(StepRecord(step, loss.item(), grad_norm(task.model), float(lr)))
        task.optimizer.step()
        if task.scheduler is not None:
            task.scheduler.step()
    return rows


def write_csv(path: Path, rows: list[StepRecord]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(StepRecord._fields)
        for r in rows:
            out.writerow((r.step, f"{r.loss:.6g}", f"{r.grad_norm:.6g}", f"{r.lr:.6g}"))


SOURCES = """# Healthy runs, made by the project

Made by `python -m spikeguard.lab.healthy_runs --out {out} --steps {steps} --seed {seed}`
(torch {torch}, one thread). Small real torch trainings, nothing injected: every
action a guard takes on them is a false one. Columns: `step,loss,grad_norm,lr`,
the loss of the step's batch, the L2 norm of the gradient before the update, the
LR the update used. The data are generated by the script (Gaussian features, a
random teacher network, sentences from a tiny grammar); no outside data.
Re-running the command remakes them (the last digits can differ across torch
versions and CPUs).

| file | steps | what |
|---|---|---|
{rows}
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spikeguard.lab.healthy_runs", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--out", default="data/healthy", help="folder for the CSVs (default data/healthy)"
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"steps per run (default {DEFAULT_STEPS})"
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=list(KINDS),
        default=list(KINDS),
        metavar="KIND",
        help="only these kinds: " + ", ".join(KINDS),
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for kind in args.kinds:
        started = time.perf_counter()
        rows = record(kind, args.steps, args.seed)
        write_csv(out / f"{kind}.csv", rows)
        print(
            f"{kind}: {len(rows)} steps, loss {rows[0].loss:.4g} -> {rows[-1].loss:.4g}, "
            f"{time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
    table = "\n".join(
        f"| {k}.csv | {args.steps} | {KINDS[k].description} |"
        for k in KINDS
        if (out / f"{k}.csv").exists()
    )
    (out / "SOURCES.md").write_text(
        SOURCES.format(
            out=args.out,
            steps=args.steps,
            seed=args.seed,
            torch=torch.__version__.split("+")[0],
            rows=table,
        ),
        encoding="utf-8",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
