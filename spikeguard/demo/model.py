"""The demo's training run: a small character-level MLP language model.

The text is the source of CPython 3.11.7's ``argparse`` module, shipped in
``corpus/`` with its licence (the same characters whichever Python runs the
demo, so the same losses as the README). The model sees a one-hot window of ``context``
characters and predicts the next one. Faults are injected by the training
loop, by *global batch index* (so a guard that skips those batches is rid
of them) or, for the LR blow-up, once (so a rollback undoes it):

- ``spike``: a few batches with inputs scaled x10^4 (a corrupted batch);
- ``nan``: a few batches poisoned with NaN inputs;
- ``divergence``: the learning rate is multiplied by 400, once;
- ``poison``: three samples *in the dataset* are garbage (their inputs get
  noise of amplitude ``spike_scale``, the same on every read); the demo
  plants them in the batch of step ``fault_step`` (``spikeguard inspect``
  finds them from the incident's record);
- ``flaky``: the device corrupts the first computation of steps
  ``fault_step..`` once each (NaN); a re-run (``verify_reruns``) is clean.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

FAULTS = ("none", "spike", "nan", "divergence", "poison", "flaky")
POISON_SLOTS = (5, 17, 29)  # positions in the poisoned batch of the three planted samples


CORPUS = Path(__file__).with_name("corpus") / "argparse_py311.txt"


def corpus() -> str:
    """About 100 kB of Python source (:data:`CORPUS`), printable ASCII and newlines."""
    text = CORPUS.read_text(encoding="utf-8")
    return "".join(c if 32 <= ord(c) < 127 or c == "\n" else " " for c in text)


class CharWindows(Dataset):
    """(window of ``context`` char ids, next char id) at every position."""

    def __init__(self, ids: torch.Tensor, context: int, vocab: int) -> None:
        self.ids, self.context, self.vocab = ids, context, vocab
        self.poisoned: dict[int, float] = {}  # index -> noise amplitude (the ``poison`` fault)

    def __len__(self) -> int:
        return len(self.ids) - self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        amplitude = self.poisoned.get(int(i))
        noise = None
        if amplitude is not None:  # garbage bytes, the same ones on every read (seeded by index)
            noise = amplitude * torch.randn(
                self.context * self.vocab, generator=torch.Generator().manual_seed(int(i))
            )
        return self.ids[i : i + self.context], self.ids[i + self.context], noise

    def collate(self, items: list) -> tuple[torch.Tensor, torch.Tensor]:
        """One-hot inputs for the whole batch at once (floats, so a fault can scale them)."""
        windows = torch.stack([w for w, _, _ in items])
        x = nn.functional.one_hot(windows, self.vocab).float().reshape(len(items), -1)
        for row, (_, _, noise) in enumerate(items):
            if noise is not None:
                x[row] += noise
        return x, torch.stack([t for _, t, _ in items])


class CharMLP(nn.Module):
    def __init__(self, context: int, vocab: int, hidden: int = 96) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(context * vocab, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, vocab),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass(frozen=True)
class DemoSetup:
    steps: int = 300
    batch_size: int = 64
    context: int = 8
    hidden: int = 96
    lr: float = 8e-3
    fault_step: int = 100  # where (in steps / batch indices) the fault strikes
    fault_batches: int = 3
    lr_blowup: float = 400.0
    spike_scale: float = 1e4
    eval_size: int = 2048


@dataclass
class Problem:
    model: CharMLP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: DataLoader
    eval_x: torch.Tensor
    eval_y: torch.Tensor

    @property
    def train(self) -> CharWindows:
        """The training windows the loader reads (where the ``poison`` fault plants)."""
        dataset = self.loader.dataset
        if not isinstance(dataset, CharWindows):
            raise TypeError(f"the demo's loader reads CharWindows, not {type(dataset).__name__}")
        return dataset


def build(seed: int, setup: DemoSetup) -> Problem:
    torch.manual_seed(seed)
    random.seed(seed)
    text = corpus()
    chars = sorted(set(text))
    ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    split = int(len(ids) * 0.9)
    vocab = len(chars)
    train = CharWindows(ids[:split], setup.context, vocab)
    held = CharWindows(ids[split:], setup.context, vocab)
    pick = torch.randperm(len(held), generator=torch.Generator().manual_seed(1234))[
        : setup.eval_size
    ]
    eval_x, eval_y = held.collate([held[int(i)] for i in pick])
    model = CharMLP(setup.context, vocab, setup.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.0)

    def cosine(step: int) -> float:  # warm-up, then cosine down to 10 %
        if step < 10:
            return (step + 1) / 10
        t = min(1.0, step / setup.steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
    loader = DataLoader(
        train, batch_size=setup.batch_size, shuffle=True, drop_last=True, collate_fn=train.collate
    )
    return Problem(model, optimizer, scheduler, loader, eval_x, eval_y)


def evaluate(problem: Problem) -> float:
    with torch.no_grad():
        logits = problem.model(problem.eval_x)
        return float(nn.functional.cross_entropy(logits, problem.eval_y))


def inject(fault: str, batch_index: int | None, x: torch.Tensor, setup: DemoSetup) -> torch.Tensor:
    """The batch as the faulty run sees it (``spike`` and ``nan`` faults live in the data)."""
    if (
        batch_index is None
        or not setup.fault_step <= batch_index < setup.fault_step + setup.fault_batches
    ):
        return x
    if fault == "spike":
        return x * setup.spike_scale
    if fault == "nan":
        return torch.full_like(x, float("nan"))
    return x


def blow_up_lr(problem: Problem, factor: float) -> None:
    """The ``divergence`` fault: a persistent LR blow-up, in the optimizer and the schedule."""
    for group in problem.optimizer.param_groups:
        group["lr"] *= factor
    problem.scheduler.base_lrs = [lr * factor for lr in problem.scheduler.base_lrs]


def plant_poison(problem: Problem, data_seed: int, setup: DemoSetup) -> list[int]:
    """The ``poison`` fault: three garbage dataset samples, placed where the guarded
    loader's first epoch reads batch ``fault_step`` (its order is seeded per epoch by the
    Guard's data wrapper: producers/data.py), so the run meets them at that step."""
    from spikeguard.producers.data import epoch_seed

    dataset = problem.train
    order = torch.randperm(
        len(dataset), generator=torch.Generator().manual_seed(epoch_seed(data_seed, 0))
    )
    batch = order[setup.fault_step * setup.batch_size : (setup.fault_step + 1) * setup.batch_size]
    planted = [int(batch[i]) for i in POISON_SLOTS]
    dataset.poisoned.update({i: setup.spike_scale for i in planted})
    return planted


def inspect_setup():
    """``spikeguard inspect INCIDENT --setup spikeguard.demo.model:inspect_setup`` for the demo's
    runs (the default DemoSetup and seed 0; a ``poison`` run's planted samples are re-planted)."""
    from spikeguard.forensics.inspect import InspectSetup

    setup = DemoSetup()
    problem = build(0, setup)
    plant_poison(problem, 0, setup)
    dataset = problem.train

    def per_sample_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y, reduction="none")

    return InspectSetup(problem.model, dataset, dataset.collate, per_sample_loss)
