"""Families of healthy runs and of faults, drawn by seed, split into a development and a test half.

A detector tuned until every development run passes has learnt those runs;
what it will do on the next user's run is what it does on runs it never saw.
So every run here is named by a seed, and the seed says which half it is in:
**even seeds are the development half, odd seeds the test half**
(:func:`half_of`). Constants are chosen on :func:`development_cases` only; the
figures that count come from :func:`test_cases` (``spikeguard evaluate
--families test``). Both halves draw from the same families, so the test half
measures generalisation to new runs, not to new kinds of run.

A run is the product of five healthy axes, each drawn from the seed:

- **noise** of one step's loss around its level: ``gaussian`` (log-normal),
  ``student_t`` (3-5 degrees of freedom), ``chi_square`` (the mean of
  ``batch`` squared Gaussian errors: a small batch's MSE) and ``mixture``
  (5-20 % of batches from a harder domain, 1.1-1.5x the loss);
- **wander** of the data difficulty, a multiplicative factor on the loss:
  ``none``, ``ar1`` (phi 0.9-0.999, stationary spread 1-6 %),
  ``random_walk`` (a walk that reverts to its mean over 2,000-20,000 steps,
  spread 1-6 %) and ``shifts`` (piecewise constant, a new level every
  200-2,000 steps, spread 1-6 %);
- **schedule** of the learning rate, which drives the loss's fall:
  ``constant``, ``warmup_cosine``, ``step_drops`` (x0.1 at 50 % and 75 %; the
  loss drops for good) and ``warm_restarts`` (cosine cycles; the loss rises
  after each restart, on purpose);
- **batch** size, which sets the step noise: 0.2-5 % of the loss in log space
  for the log-normal, Student-t and mixture noise; ``chi_square`` takes the
  batch size as its degrees of freedom;
- **kind** of loss: ``positive`` (falls to 1-4), ``near_zero`` (falls to
  1e-4-1e-3) and ``signed`` (a loss that crosses zero, such as a Gaussian NLL:
  the positive curve shifted down, its noise additive).

and at most one **fault** family (:data:`FAULTS`), labelled where it is put:

- ``spikes``: 1-4 single-point spikes of 1.3-50x, each after the one before
  healed (at least 300 steps apart); in half of the runs the first is the
  largest, the class of fault a detector that learns from healed spikes
  misses;
- ``multi_step``: a spike that lasts 3-30 steps (a plateau or a decay);
- ``slow_divergence``: the loss leaves its curve over 200-2,000 steps and
  never comes back (2-5x at the end); labelled only if it rises above where it
  stood when the fault began (a loss that only falls more slowly is labelled
  nowhere);
- ``lr_blowup``: the LR is multiplied by 10-100; the gradient norm explodes
  and the loss climbs within 5-50 steps, to 5-50x, and stays there;
- ``nan``: 1-3 NaN losses (one or a short burst), the run healthy around them.

A spike is never smaller than 1.3x, nor than ``SPIKE_SIGMAS`` robust sigmas
of the upper side of the run's own log step noise, nor than 1.1x the 99.9th
percentile of that noise (a mixture's hard batches): smaller ones are not told
apart from healthy noise by any rule, and a label nobody can earn measures
nothing. A run whose noise allows no spike within 50x (``chi_square`` with a
batch of 1 or 4) gets the ``nan`` fault instead. Steps are labelled where the injected
excess exceeds ``LABEL_SIGMAS`` robust sigmas of the step noise (the wander
included, for a slow divergence, which only the wander can hide); an LR blow-up from
the step its LR is multiplied, where the fault is already in the run.
"""

from __future__ import annotations

import math
import zlib
from typing import NamedTuple

import numpy as np

from spikeguard.lab.runfile import StepLabel
from spikeguard.schemas import StepEvent

DEVELOPMENT, TEST = "development", "test"
HALVES = (DEVELOPMENT, TEST)

NOISES = ("gaussian", "student_t", "chi_square", "mixture")
WANDERS = ("none", "ar1", "random_walk", "shifts")
SCHEDULES = ("constant", "warmup_cosine", "step_drops", "warm_restarts")
BATCHES = (1, 4, 16, 64, 256, 1024)
KINDS = ("positive", "near_zero", "signed")
FAULTS = ("none", "spikes", "multi_step", "slow_divergence", "lr_blowup", "nan")

SPIKE_SIGMAS = 8.0  # a labelled spike is at least this many robust sigmas of log step noise
LABEL_SIGMAS = 3.0  # a step is labelled while the injected excess exceeds this many
SPIKE_MIN, SPIKE_MAX = 1.3, 50.0
DEFAULT_STEPS = 4000


class Family(NamedTuple):
    """The healthy axes of one run."""

    noise: str
    wander: str
    schedule: str
    batch: int
    kind: str


class Case(NamedTuple):
    """One run of the families: its seed names it and says its half."""

    seed: int
    family: Family
    fault: str
    steps: int

    @property
    def half(self) -> str:
        return half_of(self.seed)

    @property
    def name(self) -> str:
        f = self.family
        return (
            f"fam-s{self.seed}-{f.noise}-{f.wander}-{f.schedule}-b{f.batch}-{f.kind}-{self.fault}"
        )


class FamilyRun(NamedTuple):
    case: Case
    events: list[StepEvent]
    labels: list[StepLabel]


def half_of(seed: int) -> str:
    """The half a seed belongs to: even seeds develop, odd seeds test."""
    return DEVELOPMENT if seed % 2 == 0 else TEST


def seeds_of(half: str, runs: int, first: int = 0) -> list[int]:
    """The first ``runs`` seeds of ``half`` from ``first`` on (seed order)."""
    if half not in HALVES:
        raise ValueError(f"half must be one of {', '.join(HALVES)}, not {half!r}")
    start = first + (first % 2 != (0 if half == DEVELOPMENT else 1))
    return list(range(start, start + 2 * runs, 2))


def case_of(seed: int, steps: int = DEFAULT_STEPS, fault: str | None = None) -> Case:
    """The family and fault a seed draws (``fault`` forces one)."""
    rng = np.random.default_rng([seed, zlib.crc32(b"family")])
    family = Family(
        str(rng.choice(NOISES)),
        str(rng.choice(WANDERS)),
        str(rng.choice(SCHEDULES)),
        int(rng.choice(BATCHES)),
        str(rng.choice(KINDS)),
    )
    drawn = str(rng.choice(FAULTS, p=[0.3, 0.25, 0.15, 0.1, 0.1, 0.1]))
    return Case(seed, family, fault or drawn, steps)


def development_cases(runs: int, steps: int = DEFAULT_STEPS) -> list[Case]:
    """The development half: the runs a constant may be chosen on."""
    return [case_of(seed, steps) for seed in seeds_of(DEVELOPMENT, runs)]


def test_cases(runs: int, steps: int = DEFAULT_STEPS) -> list[Case]:
    """The test half: the runs the reported figures come from, never tuned on."""
    return [case_of(seed, steps) for seed in seeds_of(TEST, runs)]


test_cases.__test__ = False  # type: ignore[attr-defined]  # (pytest: not a test)


def generate(case: Case) -> FamilyRun:
    """The run of ``case``: its events and a label per step. Same case, same run."""
    if case.steps < 500:
        raise ValueError(f"steps must be at least 500 (got {case.steps}): faults need history")
    rng = np.random.default_rng([case.seed, zlib.crc32(case.fault.encode()), case.steps])
    n, f = case.steps, case.family
    lr = _schedule(rng, f.schedule, n)
    log_level = _level(rng, lr, f.kind)
    log_noise = _noise(rng, f, n)
    sigma = _upper_sigma(log_noise)
    floor = _spike_floor(log_noise, sigma)
    wander = _wander(rng, f.wander, n)
    log_grad = _grad(rng, lr, n) + 0.02 * np.clip(log_noise / max(sigma, 1e-12), -6, 6)
    excess = np.zeros(n)  # log excess of the loss the fault adds
    label = np.zeros(n, dtype=bool)
    nan_at: list[int] = []
    fault = case.fault
    if fault in ("spikes", "multi_step") and floor > SPIKE_MAX:
        fault = "nan"  # this noise hides any spike up to 50x
    earliest = max(300, n // 10)
    if fault == "spikes":
        _spikes(rng, n, floor, earliest, excess, label, log_grad)
    elif fault == "multi_step":
        _multi_step(rng, n, floor, sigma, earliest, excess, label, log_grad)
    elif fault == "slow_divergence":
        _slow_divergence(rng, n, sigma, _spread(wander), log_level, excess, label, log_grad)
    elif fault == "lr_blowup":
        _lr_blowup(rng, n, sigma, lr, excess, label, log_grad)
    elif fault == "nan":
        nan_at = _nans(rng, n, earliest, label)
    positive = np.exp(log_level + wander + log_noise + excess)
    loss = _of_kind(rng, positive, log_level, f.kind)
    loss[nan_at] = math.nan
    grad = np.exp(log_grad)
    case = case._replace(fault=fault)
    run_id = case.name
    events = [
        StepEvent(
            run_id=run_id,
            step=i,
            time=float(i),
            loss=float(loss[i]),
            grad_norm=float(grad[i]),
            lr=float(lr[i]),
        )
        for i in range(n)
    ]
    kinds = "non_finite" if fault == "nan" else fault
    labels = [StepLabel(True, kinds) if b else StepLabel(False, "") for b in label]
    return FamilyRun(case, events, labels)


def _schedule(rng: np.random.Generator, schedule: str, n: int) -> np.ndarray:
    peak = float(np.exp(rng.uniform(math.log(1e-4), math.log(3e-3))))
    t = np.arange(n, dtype=float)
    if schedule == "constant":
        return np.full(n, peak)
    if schedule == "warmup_cosine":
        warm = int(n * rng.uniform(0.02, 0.08))
        scale = 0.5 * (1 + np.cos(np.pi * np.clip((t - warm) / (n - warm), 0, 1)))
        scale = 0.05 + 0.95 * scale
        scale[:warm] = (t[:warm] + 1) / warm
        return peak * scale
    if schedule == "step_drops":
        return peak * np.where(t < n // 2, 1.0, np.where(t < 3 * n // 4, 0.1, 0.01))
    cycles = int(rng.integers(2, 5))  # warm restarts
    period = n / cycles
    return peak * (0.05 + 0.95 * 0.5 * (1 + np.cos(np.pi * (t % period) / period)))


def _level(rng: np.random.Generator, lr: np.ndarray, kind: str) -> np.ndarray:
    """Log of the healthy curve: it falls with the area under the LR, and sits higher while the
    LR is high (so an LR drop lowers the loss, a restart raises it)."""
    progress = np.cumsum(lr) / lr.max()
    start = float(rng.uniform(4.0, 11.0))
    end = float(rng.uniform(1.0, 4.0)) if kind != "near_zero" else float(10 ** rng.uniform(-4, -3))
    tau = float(rng.uniform(0.01, 0.1)) * progress[-1]
    shape = (1 + progress / tau) ** -float(rng.uniform(0.4, 1.0))
    shape = (shape - shape[-1]) / (shape[0] - shape[-1])
    lr_term = float(rng.uniform(0.02, 0.1)) * lr / lr.max()
    return np.log(end + (start - end) * shape) + lr_term


def _noise(rng: np.random.Generator, f: Family, n: int) -> np.ndarray:
    """Log step noise, centred on 0 in median."""
    if f.noise == "chi_square":
        x = np.log(rng.chisquare(f.batch, n) / f.batch)
        return x - np.median(x)
    sigma = float(np.clip(0.1 / math.sqrt(f.batch) * rng.uniform(0.5, 1.0), 0.002, 0.05))
    if f.noise == "gaussian":
        return sigma * rng.standard_normal(n)
    if f.noise == "student_t":
        df = float(rng.uniform(3, 5))
        return sigma * rng.standard_t(df, n) / math.sqrt(df / (df - 2))
    hard = rng.random(n) < rng.uniform(0.05, 0.2)  # mixture: some batches from a harder domain
    return sigma * rng.standard_normal(n) + hard * math.log(rng.uniform(1.1, 1.5))


def _wander(rng: np.random.Generator, wander: str, n: int) -> np.ndarray:
    """Log of the data difficulty over the run (0: none)."""
    spread = float(rng.uniform(0.01, 0.06))
    if wander == "none":
        return np.zeros(n)
    if wander == "shifts":
        out = np.empty(n)
        at = 0
        while at < n:
            length = int(rng.integers(200, 2001))
            out[at : at + length] = spread * rng.standard_normal()
            at += length
        return out
    phi = (
        float(rng.uniform(0.9, 0.999))
        if wander == "ar1"
        else 1 - 1 / float(rng.uniform(2000, 20000))  # a slowly reverting random walk
    )
    eps = rng.standard_normal(n) * spread * math.sqrt(1 - phi**2)
    out = np.empty(n)
    out[0] = spread * rng.standard_normal()
    for i in range(1, n):
        out[i] = phi * out[i - 1] + eps[i]
    return out


def _grad(rng: np.random.Generator, lr: np.ndarray, n: int) -> np.ndarray:
    t = np.arange(n, dtype=float)
    end = float(np.exp(rng.uniform(math.log(0.1), math.log(2.0))))
    decay = (1 + t / rng.uniform(10, 200)) ** -rng.uniform(0.3, 0.7)
    return math.log(end) + math.log(rng.uniform(3, 30)) * decay + 0.05 * rng.standard_normal(n)


def _upper_sigma(x: np.ndarray) -> float:
    """A robust sigma of the upper side of the noise (where spikes are): (q75 - median) / 0.6745."""
    return float((np.quantile(x, 0.75) - np.median(x)) / 0.6745)


def _spread(wander: np.ndarray) -> float:
    return float(np.std(wander))


def _spike_floor(log_noise: np.ndarray, sigma: float) -> float:
    """The smallest labelled spike of a run: 1.3x, ``SPIKE_SIGMAS`` upper sigmas of its
    step noise, and 1.1x the 99.9th percentile of that noise (a mixture's hard batches)."""
    top = float(np.quantile(log_noise, 0.999)) + math.log(1.1)
    return max(SPIKE_MIN, math.exp(SPIKE_SIGMAS * sigma), math.exp(top))


def _log_size(rng: np.random.Generator, floor: float, top: float = SPIKE_MAX) -> float:
    """A log spike size, log-uniform between ``floor`` and ``top``."""
    low = math.log(floor)
    return float(rng.uniform(low, max(low, math.log(top))))


def _spikes(rng, n, floor, earliest, excess, label, log_grad) -> None:
    count = int(rng.integers(1, 5))
    sizes = [_log_size(rng, floor) for _ in range(count)]
    if rng.random() < 0.5:  # the first is the largest: a healed big one must not hide the next
        sizes.sort(reverse=True)
    at = earliest + int(rng.integers(0, 200))
    for size in sizes:
        if at >= n - 50:
            break
        excess[at] += size
        label[at] = True
        log_grad[at] += size * rng.uniform(0.3, 1.5)
        at += int(rng.integers(300, max(301, (n - earliest) // count)))


def _multi_step(rng, n, floor, sigma, earliest, excess, label, log_grad) -> None:
    length = int(rng.integers(3, 31))
    at = int(rng.integers(earliest, n - length - 100))
    size = _log_size(rng, floor, top=10.0)
    flat = rng.random() < 0.5
    profile = np.full(length, size) if flat else size * np.exp(-np.arange(length) / (length / 3))
    excess[at : at + length] += profile
    label[at : at + length] = profile > LABEL_SIGMAS * sigma
    log_grad[at : at + length] += profile * rng.uniform(0.3, 1.5)


def _slow_divergence(rng, n, sigma, spread, log_level, excess, label, log_grad) -> None:
    length = min(int(rng.integers(200, 2001)), n // 2)
    at = n - length
    peak = math.log(rng.uniform(2.0, 5.0))
    profile = peak * (np.arange(1, length + 1) / length) ** rng.uniform(1.0, 2.0)
    excess[at:] += profile
    bar = LABEL_SIGMAS * math.hypot(sigma, spread)
    # A divergence is a loss that goes up: labelled (where the excess passes the bar) only if
    # the fault lifts the loss above where it stood when the fault began. Where the curve falls
    # faster than the fault lifts it (a near-zero loss falling x100 over the same steps), the
    # loss only falls more slowly, which no rule that does not know the curve can tell.
    if np.any(log_level[at:] + profile > log_level[at] + bar):
        label[at:] = profile > bar
    log_grad[at:] += profile * rng.uniform(0.5, 1.5)


def _lr_blowup(rng, n, sigma, lr, excess, label, log_grad) -> None:
    at = int(rng.integers(n // 2, n - 100))
    lr[at:] *= rng.uniform(10, 100)
    climb = int(rng.integers(5, 51))
    peak = math.log(rng.uniform(5.0, 50.0))
    t = np.arange(n - at)
    profile = peak * np.clip(t / climb, 0, 1) ** 2
    excess[at:] += profile
    # Labelled from the step the LR is multiplied: the fault is in the run there (its LR, its
    # gradient norm) before the loss shows it, so an alarm on the jump is a true one.
    label[at:] = True
    log_grad[at:] += math.log(rng.uniform(10, 1000)) * np.clip((t + 1) / climb, 0, 1)


def _nans(rng, n, earliest, label) -> list[int]:
    at = int(rng.integers(earliest, n - 50))
    burst = list(range(at, at + int(rng.integers(1, 4))))
    label[burst] = True
    return burst


def _of_kind(rng, positive: np.ndarray, log_level: np.ndarray, kind: str) -> np.ndarray:
    """The loss a trainer logs: ``signed`` shifts the curve down so that it crosses zero."""
    if kind != "signed":
        return positive
    start, end = float(np.exp(log_level[0])), float(np.exp(log_level[-1]))
    return positive - rng.uniform(1.1 * end, max(1.1 * end, min(0.9 * start, 3 * end)))
