"""The lab's mechanisms: each an unstable recipe, its healthy twin, and where it was published.

Every instability here is a consequence of the recipe, nothing is injected:
the same model and data, one or two knobs turned the way the papers say
breaks training. The twin is the same run with the published fix on (or the
safe setting), so the twin's loss is the reference the labels are judged
against (:mod:`.labels`). ``HEALTHY`` is the recipe at a safe LR, the twin of
every mechanism's LR.
"""

from __future__ import annotations

from dataclasses import dataclass

from spikeguard.lab.instability.train import Recipe

#: 200 steps of a 2-layer, 64-wide character GPT: ~10 s a run on a quiet core.
BASE = Recipe(steps=200)
HEALTHY = BASE  # LR 3e-3, warm-up 30, β₂ 0.95: trains cleanly on every seed


@dataclass(frozen=True)
class Mechanism:
    name: str
    source: str
    unstable: Recipe
    twin: Recipe
    twin_is: str  # what the twin changes


MECHANISMS = (
    Mechanism(
        "attention_logit_growth",
        "Wortsman et al. 2023, Small-scale proxies for large-scale Transformer training "
        "instabilities, sec. 3.1 (after Dehghani et al. 2023, ViT-22B)",
        BASE.with_(lr=0.03),
        BASE.with_(lr=0.03, qk_norm=True),
        "QK-layernorm on",
    ),
    Mechanism(
        "output_logit_divergence",
        "Wortsman et al. 2023, sec. 3.2; z-loss from PaLM (Chowdhery et al. 2022)",
        BASE.with_(lr=0.3, qk_norm=True),
        BASE.with_(lr=0.3, qk_norm=True, z_loss=1e-4),
        "z-loss 1e-4 on",
    ),
    Mechanism(
        "short_warmup",
        "Wortsman et al. 2023, sec. 3.4 (warm-up lowers LR sensitivity); Liu et al. 2020, "
        "On the Variance of the Adaptive Learning Rate and Beyond (RAdam)",
        BASE.with_(lr=0.03, qk_norm=True, warmup=1),
        BASE.with_(lr=0.03, qk_norm=True, warmup=30),
        "warm-up 30 steps instead of 1",
    ),
    Mechanism(
        "stale_second_moment",
        "Molybog et al. 2023, A Theory on Adam Instability in Large-Scale Machine Learning "
        "(a slow second moment lags the gradients it divides)",
        BASE.with_(lr=0.01, qk_norm=True, beta2=0.999),
        BASE.with_(lr=0.01, qk_norm=True, beta2=0.95),
        "Adam beta2 0.95 instead of 0.999",
    ),
)
BY_NAME = {m.name: m for m in MECHANISMS}
