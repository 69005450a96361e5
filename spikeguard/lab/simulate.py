"""Labelled synthetic training runs, calibrated on real loss logs.

``generate(scenario, steps, seed)`` makes one run: a :class:`StepEvent` per
step (loss, grad_norm, lr always set; update_norm in about half the runs) and
a :class:`StepLabel` per step saying whether it lies inside an anomaly episode
and of what kind. Same arguments, same run, on every machine.

What a healthy run looks like (calibrated on the 75 modded-nanogpt logs in
the shared data folder):

- The loss falls as a power law of the learning-rate "area" (so it stalls
  during warm-up and dips as the LR anneals): warm-up 0-8 % of the run, then
  cosine, linear, warmup-stable-decay or constant LR. Pre-training runs start
  at ln(vocab)-like values (6.5-11.5) and end at 1.6-4.2; fine-tuning runs
  start at 0.8-5 and end at 35-85 % of that, so scales span ~0.4 to ~11.5.
- Per-step noise is multiplicative: in log space its robust sigma (1.4826 x
  MAD) is 0.006-0.06 (real: 0.011 for llm.c/AdamW, 0.024 for Muon, 0.055 for
  the 1B run), drifting by up to a few tens of percent over the run,
  Student-t (real core kurtosis 4-5 -> df 4-12; df 2.2-3.5 in
  ``heavy_tailed``), a little right-skewed, not autocorrelated (real lag-1
  autocorrelation ~ -0.03).
- Benign blips: isolated upward jumps that heal in one step (real: 425 of 428
  jumps above 8 sigmas healed in one step, 3 in two). Real sizes: 8-22 sigmas,
  median ~11, at most x1.97. One every 300-3000 steps (every 120-400 in
  ``heavy_tailed``; the 1B run has one per ~200 steps). A quarter as many
  one-step dips (``benign_dip``; real: down to x0.32 in the 1B run).
- The gradient norm decays from 3-60x its final value in the first tens of
  steps (real: 15 -> 0.25), with log noise 0.03-0.12 (real 0.056), slight
  autocorrelation, and its own benign one-step spikes up to x7.5 (real llm.c
  run: x7 at step 9025, with no effect on the loss).

**Labelling policy.** Real healthy runs contain isolated one-step jumps up to
~x2 / ~22 noise sigmas that heal by themselves; here they are *benign*
(``kind="benign_blip"``, label False), as are one-step dips, eval-boundary
bumps (3-8 sigmas over 1-3 steps) and the step *down* in loss when the data
changes (``benign_dip``, ``benign_eval_bump``, ``benign_data_shift``). A
labelled transient spike is always bigger than any blip of its run: at least
x1.5 AND at least 28 noise sigmas (so x1.5 in a quiet run, ~x4 in the
noisiest), at most x10 (and loss <= 40), whether it heals at once, decays over
3-150 steps or sits on a plateau for 5-300 steps: at its first step nobody can
tell which, so size alone decides. A third of the sudden spikes persist (>= 70 %
of their size for 5+ steps); those start at x1.5 AND 12 sigmas, as small as a
big blip, and only their second step gives them away (expect a delay of 1). Gradient explosions start at x25 the
gradient-norm trend (benign grad spikes stay under x7.5). An episode runs from
its first to its last step whose injected log-excess exceeds 3 noise sigmas;
gradual rises are labelled from there, not from their invisible onset. Steps
with a non-finite loss or grad norm are ``non_finite`` episodes of their own,
even inside another anomaly. A gradual grad-norm climb before an explosion,
and an LR raised before an oscillation, are ``kind="precursor"`` with label
False: what a predictor may warn about, not an anomaly.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from spikeguard.lab import scenarios as sc
from spikeguard.lab.runfile import StepLabel
from spikeguard.processors.robust_stats import robust_sigma_array
from spikeguard.schemas import StepEvent

SCENARIOS: dict[str, str] = {
    "stable": "a healthy run: power-law decay, warm-up + LR schedule, real-like noise and blips",
    "heavy_tailed": "a healthy run with heavy-tailed noise and frequent benign blips",
    "data_shift": "a healthy run whose loss steps down when the data changes (benign)",
    "eval_bumps": "a healthy run with small bumps after evaluation boundaries (benign)",
    "sudden_spike": "loss jumps x1.5-x10 (above any benign blip), then heals, decays or plateaus",
    "gradual_spike": "loss climbs over 20-400 steps to x1.3-x4, then recovers",
    "divergence": "loss climbs and never recovers; sometimes ends in NaN",
    "oscillation": "loss (and grad norm) oscillate with growing amplitude, sometimes after an LR jump",
    "non_finite": "NaN/Inf loss or gradient norm: single steps, bursts, or a blow-up at the end",
    "grad_explosion": "grad norm explodes (often after a slow climb); the loss spikes 1-10 steps later",
}
ANOMALY_KINDS = (
    "sudden_spike",
    "gradual_spike",
    "divergence",
    "oscillation",
    "non_finite",
    "grad_explosion",
)
_CLEAN = ("stable", "heavy_tailed", "data_shift", "eval_bumps")
_SUITE_LENGTHS = (2000, 3500, 6000, 10000)


@dataclass
class LabelledRun:
    scenario: str
    seed: int
    events: list[StepEvent]
    labels: list[StepLabel]
    params: dict[str, float | str] = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.events[0].run_id if self.events else ""


@dataclass(frozen=True)
class SuiteItem:
    scenario: str
    steps: int
    seed: int

    def generate(self) -> LabelledRun:
        return generate(self.scenario, self.steps, self.seed)


def default_suite(seeds: Iterable[int] = range(4), scenarios: Iterable[str] | None = None):
    """Every scenario x ``seeds``; lengths cycle 2,000-10,000 steps (+-15 %).

    Divergence ends a run, so it gets three shorter runs per seed. 4 seeds: ~230k steps.
    """
    items = []
    for i, name in enumerate(scenarios or SCENARIOS):
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
        for seed in seeds:
            rng = np.random.default_rng([seed, 7919, zlib.crc32(name.encode())])
            if name == "divergence":  # one episode a run (it ends the run): three shorter runs
                for k in range(3):
                    steps = int(rng.uniform(1500, 4000))
                    items.append(SuiteItem(name, steps, int(seed) + 1000 * k))
                continue
            base = _SUITE_LENGTHS[(i + seed) % len(_SUITE_LENGTHS)]
            items.append(SuiteItem(name, int(base * rng.uniform(0.85, 1.15)), int(seed)))
    return items


def generate(scenario: str, steps: int, seed: int, run_id: str | None = None) -> LabelledRun:
    """One labelled run of ``scenario`` (see :data:`SCENARIOS`), ``steps`` steps long."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
    if steps < 200:
        raise ValueError(f"steps must be at least 200 (got {steps}): detectors need a history")
    rng = np.random.default_rng([int(seed), zlib.crc32(scenario.encode())])
    heavy = scenario == "heavy_tailed"
    canvas, params = _healthy(rng, steps, heavy)
    _INJECT[scenario](canvas)
    if scenario not in _CLEAN:  # anomalous runs have benign events too, now and then
        if rng.random() < 0.2:
            sc.data_shift(canvas, most=1)
        if rng.random() < 0.25:
            sc.eval_bumps(canvas)
    rate = sc.loguniform(rng, 1 / 400, 1 / 120) if heavy else sc.loguniform(rng, 1 / 3000, 1 / 300)
    grad_rate = (
        sc.loguniform(rng, 1 / 1500, 1 / 300) if heavy else sc.loguniform(rng, 1 / 5000, 1 / 600)
    )
    _blips(canvas, rate, grad_rate)
    params.update(blip_rate=rate, grad_blip_rate=grad_rate)
    run_id = run_id or f"sim-{scenario}-s{seed}-n{steps}"
    events = _render(canvas, rng, run_id, params)
    return LabelledRun(scenario, int(seed), events, _labels(canvas), params)


def _healthy(rng: np.random.Generator, n: int, heavy: bool) -> tuple[sc.Canvas, dict]:
    t = np.arange(n, dtype=float)
    lr, warm, lr_params = _lr_schedule(rng, n)
    progress = np.cumsum(lr) / lr.max()  # training progress = area under the LR
    if rng.random() < 0.6:  # pre-training from scratch
        start, end = rng.uniform(6.5, 11.5), sc.loguniform(rng, 1.6, 4.2)
    else:  # fine-tuning
        start = sc.loguniform(rng, 0.8, 5.0)
        end = start * rng.uniform(0.35, 0.85)
    tau = sc.loguniform(rng, 0.002, 0.05) * progress[-1]
    alpha = rng.uniform(0.3, 1.0)
    f = (1 + progress / tau) ** -alpha
    shape = (f - f[-1]) / (f[0] - f[-1])
    anneal = rng.uniform(0, 0.05) * (1 - lr / lr.max()) * (t >= warm)
    log_trend = np.log(end + (start - end) * shape) - anneal

    sigma0 = sc.loguniform(rng, 0.015, 0.06) if heavy else sc.loguniform(rng, 0.006, 0.06)
    sigma = sigma0 * (1 + rng.uniform(-0.2, 0.5) * (t / n - 0.5))
    df = rng.uniform(2.2, 3.5) if heavy else rng.uniform(4, 12)
    e = _robust_unit(rng.standard_t(df, n), skew=rng.uniform(0, 0.25))
    e = np.clip(e, -6, 10 if heavy else 7)  # beyond that is the blips' business
    noise = sigma * e

    g_end = sc.loguniform(rng, 0.05, 3.0)
    g_start = g_end * sc.loguniform(rng, 3, 60)
    decay = (1 + t / sc.loguniform(rng, 5, 100)) ** -rng.uniform(0.4, 0.8)
    g_drift = rng.uniform(-0.3, 0.5) * (1 - lr / lr.max()) * (t >= warm)
    g_sigma = sc.loguniform(rng, 0.03, 0.12)
    ge = _robust_unit(rng.standard_t(rng.uniform(4, 8), n), skew=0.0)
    ge = np.clip(ge, -6, 6) + rng.uniform(0, 0.4) * e  # grad and loss noise correlate a little
    phi = rng.uniform(0, 0.3)
    for i in range(1, n):  # AR(1): the gradient norm remembers a little
        ge[i] += phi * ge[i - 1]
    log_grad = math.log(g_end) + math.log(g_start / g_end) * decay + g_drift + g_sigma * ge

    earliest = max(150, int(0.04 * n))
    canvas = sc.Canvas(rng, log_trend, sigma, noise, log_grad, lr, earliest)
    params = dict(
        lr_params,
        loss_start=start,
        loss_end=end,
        alpha=alpha,
        sigma=sigma0,
        df=df,
        grad_end=g_end,
        grad_sigma=g_sigma,
    )
    return canvas, params


def _blips(c: sc.Canvas, rate: float, grad_rate: float) -> None:
    """Benign: isolated one-step jumps that heal at once, sized like the real ones."""
    free = ~c.busy
    free[:20] = False
    for i in np.flatnonzero(free & (c.rng.random(c.n) < rate)).tolist():
        z = min(sc.BLIP_Z_MAX, 8 * math.exp(abs(c.rng.normal(0, 0.33))))
        size = min(z * c.sigma[i], sc.LOG_BLIP_MAX)
        c.noise[i] = size  # replaces that step's noise, so no blip exceeds the caps
        c.log_grad[i] += size * c.rng.uniform(0, 1.0)
        c.mark(i, i + 1, "benign_blip", label=False)
        if i + 1 < c.n and c.rng.random() < 0.1:
            c.noise[i + 1] += size * c.rng.uniform(0.2, 0.6)
            c.mark(i + 1, i + 2, "benign_blip", label=False)
    for i in np.flatnonzero(free & (c.rng.random(c.n) < rate / 4) & (c.kind == "")).tolist():
        z = 6 * math.exp(abs(c.rng.normal(0, 0.4)))  # an easy batch: the loss dips for a step
        c.noise[i] = -min(z * c.sigma[i], sc.LOG_DIP_MAX)
        c.mark(i, i + 1, "benign_dip", label=False)
    for i in np.flatnonzero(free & (c.rng.random(c.n) < grad_rate)).tolist():
        c.log_grad[i] += c.rng.uniform(math.log(2.0), sc.GRAD_BLIP_MAX)
        if c.kind[i] == "":
            c.mark(i, i + 1, "benign_grad_blip", label=False)


def _lr_schedule(rng: np.random.Generator, n: int):
    peak = sc.loguniform(rng, 1e-4, 3e-3)
    warm = int(n * rng.uniform(0, 0.08)) if rng.random() < 0.85 else 0
    kind = str(rng.choice(["cosine", "cosine", "linear", "wsd", "constant"]))
    floor = rng.uniform(0, 0.15)
    t = np.arange(n, dtype=float)
    frac = np.clip((t - warm) / max(1, n - warm), 0, 1)
    if kind == "cosine":
        scale = floor + (1 - floor) * 0.5 * (1 + np.cos(np.pi * frac))
    elif kind == "linear":
        scale = 1 - (1 - floor) * frac
    elif kind == "wsd":
        cut = 1 - rng.uniform(0.1, 0.4)
        scale = np.where(frac < cut, 1.0, 1 - (1 - floor) * (frac - cut) / (1 - cut))
    else:
        scale = np.ones(n)
    if warm:
        scale[:warm] = (t[:warm] + 1) / warm
    return peak * scale, warm, {"lr_peak": peak, "warmup": warm, "schedule": kind}


def _robust_unit(x: np.ndarray, skew: float) -> np.ndarray:
    """Centre on the median, stretch the upper side by ``skew``, scale to unit robust sigma."""
    x = x - np.median(x)
    x = np.where(x > 0, x * (1 + skew), x * (1 - skew))
    return (x - np.median(x)) / robust_sigma_array(x)


def _render(c: sc.Canvas, rng: np.random.Generator, run_id: str, params: dict) -> list[StepEvent]:
    n = c.n
    loss = np.exp(c.log_trend + c.noise + c.loss_ex)
    grad = np.exp(c.log_grad + c.grad_ex)
    for i, v in c.loss_nonfinite.items():
        loss[i] = v
    for i, v in c.grad_nonfinite.items():
        grad[i] = v
    update = None
    if rng.random() < 0.5:
        noise = rng.normal(0, 0.02, n)
        update = c.lr * sc.loguniform(rng, 10, 3000) * np.exp(noise + c.update_ex)
    params["update_norm"] = "yes" if update is not None else "no"
    dt = rng.uniform(0.05, 2.0) * np.exp(rng.normal(0, 0.05, n))
    for i, extra in c.pauses.items():
        dt[i] += extra
    clock = 1.7e9 + rng.uniform(0, 1e7) + np.cumsum(dt)
    first = int(rng.integers(0, 2))  # some trainers count from 0, some from 1
    events = []
    for i in range(n):
        events.append(
            StepEvent(
                run_id=run_id,
                step=first + i,
                time=float(clock[i]),
                loss=float(loss[i]),
                grad_norm=float(grad[i]),
                lr=float(c.lr[i]),
                update_norm=None if update is None else float(update[i]),
            )
        )
    return events


def _labels(c: sc.Canvas) -> list[StepLabel]:
    return [StepLabel(bool(b), str(k)) for b, k in zip(c.label, c.kind, strict=True)]


_INJECT: dict[str, Callable[[sc.Canvas], None]] = {
    "stable": lambda c: None,
    "heavy_tailed": lambda c: None,
    "data_shift": sc.data_shift,
    "eval_bumps": sc.eval_bumps,
    "sudden_spike": sc.sudden_spike,
    "gradual_spike": sc.gradual_spike,
    "divergence": sc.divergence,
    "oscillation": sc.oscillation,
    "non_finite": sc.non_finite,
    "grad_explosion": sc.grad_explosion,
}
