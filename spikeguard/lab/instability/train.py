"""One lab run: a recipe, a seed, and optionally responses; the record of every step.

The loop is plain AdamW with warm-up then cosine decay; the recipe's knobs are
the ones the mechanisms turn (learning rate, warm-up, QK-layernorm, z-loss,
Adam's β₂ and ε). Signals are read on every step with one transfer
(:class:`~spikeguard.producers.signals.MechanismSignals`); responses
(:mod:`.responses`) see them after each update and may change the run.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import torch

from spikeguard.lab.instability.data import CharText
from spikeguard.lab.instability.model import LabGPT, ModelConfig, lm_loss
from spikeguard.producers.signals import MechanismSignals, StepSignals


@dataclass(frozen=True)
class Recipe:
    """What a run trains with. Defaults are a healthy run; a mechanism changes a few fields."""

    steps: int = 300
    batch_size: int = 16
    block: int = 32
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    lr: float = 3e-3
    warmup: int = 30
    min_lr_fraction: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    qk_norm: bool = False
    z_loss: float = 0.0
    eval_every: int = 0  # 0: evaluate only at the end
    eval_batches: int = 4

    def with_(self, **changes) -> Recipe:
        return replace(self, **changes)


def lr_factor(recipe: Recipe, step: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine to ``min_lr_fraction``."""
    if step < recipe.warmup:
        return (step + 1) / recipe.warmup
    progress = min(1.0, (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup))
    low = recipe.min_lr_fraction
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float
    lr: float
    signals: StepSignals
    update_norm: float = math.nan


@dataclass
class LabRun:
    recipe: Recipe
    seed: int
    steps: list[StepRecord] = field(default_factory=list)
    final_eval_loss: float = math.nan
    seconds: float = 0.0
    responses: list[str] = field(default_factory=list)  # what each response did, and when

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.steps]


class Trainer:
    """What a response may touch: the model, the optimizer, the LR multiplier, the z-loss."""

    def __init__(self, model: LabGPT, optimizer: torch.optim.Optimizer, recipe: Recipe) -> None:
        self.model, self.optimizer, self.recipe = model, optimizer, recipe
        self.lr_scale = 1.0  # a response's multiplier on the schedule
        self.z_loss = recipe.z_loss


class Response(Protocol):
    def after_step(self, step: int, signals: StepSignals, trainer: Trainer) -> str | None:
        """Act on this step's signals; a line saying what was done, or None."""


def build_model(recipe: Recipe, vocab: int) -> LabGPT:
    cfg = ModelConfig(
        vocab=vocab,
        block=recipe.block,
        d_model=recipe.d_model,
        layers=recipe.layers,
        heads=recipe.heads,
        qk_norm=recipe.qk_norm,
    )
    return LabGPT(cfg)


def train(
    recipe: Recipe,
    seed: int,
    responses: Callable[[LabGPT], Sequence[Response]] | None = None,
    signals: bool = True,
    text: CharText | None = None,
) -> LabRun:
    """Train ``recipe`` from ``seed``; the same arguments give the same run.

    ``responses`` builds, from the model, the responses that see each step's signals.
    """
    torch.manual_seed(seed)
    text = text if text is not None and text.block == recipe.block else CharText(recipe.block)
    model = build_model(recipe, text.vocab)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=recipe.lr,
        betas=(recipe.beta1, recipe.beta2),
        eps=recipe.eps,
        weight_decay=recipe.weight_decay,
    )
    trainer = Trainer(model, optimizer, recipe)
    acting = list(responses(model)) if responses is not None else []
    probe = (
        MechanismSignals(model.attention_scores(), model.head, model.layer_parameters())
        if signals
        else None
    )
    batches = torch.Generator().manual_seed(seed)
    run = LabRun(recipe, seed)
    started = time.perf_counter()
    params = list(model.parameters())
    for step in range(recipe.steps):
        lr = recipe.lr * lr_factor(recipe, step) * trainer.lr_scale
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = text.batch(recipe.batch_size, batches)
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y, trainer.z_loss)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, math.inf)
        if probe is not None:
            probe.before_update()
        optimizer.step()
        if probe is not None:
            probe.after_update()
            values = torch.stack([loss.detach(), grad_norm]).tolist()
            seen = probe.collect()
        else:
            values = torch.stack([loss.detach(), grad_norm]).tolist()
            seen = StepSignals()
        run.steps.append(StepRecord(step, values[0], values[1], lr, seen))
        for response in acting:
            said = response.after_step(step, seen, trainer)
            if said:
                run.responses.append(f"step {step}: {said}")
    run.seconds = time.perf_counter() - started
    if probe is not None:
        probe.close()
    run.final_eval_loss = evaluate(model, text, recipe, seed)
    return run


@torch.no_grad()
def evaluate(model: LabGPT, text: CharText, recipe: Recipe, seed: int) -> float:
    """Mean cross-entropy (no z-loss) on ``eval_batches`` held-out batches, fixed by ``seed``."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    total = 0.0
    for _ in range(recipe.eval_batches):
        x, y = text.batch(64, generator, held=True)
        total += float(lm_loss(model(x), y))
    return total / recipe.eval_batches
