"""What goes wrong (and what only looks wrong) in a synthetic run.

A :class:`Canvas` holds one healthy run as arrays (log-loss trend and noise,
log gradient norm, learning rate); the injectors here add anomalies and benign
events to it and write the labels. Everything is in log space, where real
loss noise is roughly constant over a run (see :mod:`.simulate` for the
calibration and the labelling policy). Every size is drawn at random within
bounds, and positions avoid each other (``busy``) so episodes stay distinct.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

LOG_BLIP_MAX = math.log(2.0)  # real healthy runs: one-step jumps up to x1.97 that heal at once
BLIP_Z_MAX = 22.0  # ... and up to ~22 robust sigmas of the run's own noise
LOG_DIP_MAX = math.log(1 / 0.35)  # ... and one-step dips down to x0.32 (an easy batch)
SPIKE_Z_MIN = 28.0  # a labelled transient spike is bigger than any benign blip, in sigmas
PERSISTENT_Z_MIN = 12.0  # one that stays up (>= 70 % for 5+ steps) needs only this much
SPIKE_MIN, SPIKE_MAX = 1.5, 10.0  # ... and in ratio to the trend
LOSS_CEILING = 40.0  # a spike does not take the loss above this
GRAD_BLIP_MAX = math.log(7.5)  # real isolated grad-norm spikes: up to x7 above trend, no harm
GRAD_EXPLOSION_MIN = 25.0  # a labelled gradient explosion starts at x25 above trend
LABEL_Z = 3.0  # a labelled episode lasts while its excess exceeds 3 noise sigmas


def loguniform(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(max(hi, lo)))))


@dataclass
class Canvas:
    """One run under construction; the final loss is exp(log_trend + noise + loss_ex)."""

    rng: np.random.Generator
    log_trend: np.ndarray
    sigma: np.ndarray  # robust per-step noise scale of log-loss
    noise: np.ndarray
    log_grad: np.ndarray  # healthy log gradient norm, noise included
    lr: np.ndarray
    earliest: int  # no anomaly before this step index (detectors need some history)
    loss_ex: np.ndarray = field(init=False)
    grad_ex: np.ndarray = field(init=False)
    update_ex: np.ndarray = field(init=False)
    loss_nonfinite: dict[int, float] = field(default_factory=dict)
    grad_nonfinite: dict[int, float] = field(default_factory=dict)
    pauses: dict[int, float] = field(default_factory=dict)  # extra seconds before a step
    label: np.ndarray = field(init=False)
    kind: np.ndarray = field(init=False)
    busy: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        n = self.n
        self.loss_ex, self.grad_ex, self.update_ex = np.zeros(n), np.zeros(n), np.zeros(n)
        self.label = np.zeros(n, dtype=bool)
        self.kind = np.full(n, "", dtype=object)
        self.busy = np.zeros(n, dtype=bool)
        self.busy[: self.earliest] = True

    @property
    def n(self) -> int:
        return len(self.log_trend)

    def place(self, length: int, before: int = 50, after: int = 150, at_end: bool = False):
        """A free start for an event of ``length`` steps (with quiet margins), or None."""
        length = max(1, int(length))
        for _ in range(200):
            if at_end:
                start = self.n - length
            else:
                hi = self.n - length - min(after, 20)
                if hi <= self.earliest:
                    return None
                start = int(self.rng.integers(self.earliest, hi))
            lo, hi = max(0, start - before), min(self.n, start + length + after)
            if start >= self.earliest and not self.busy[lo:hi].any():
                self.busy[lo:hi] = True
                return start
            if at_end:
                return None
        return None

    def mark(self, start: int, stop: int, kind: str, label: bool = True) -> None:
        stop = min(stop, self.n)
        self.label[start:stop] = label
        self.kind[start:stop] = kind

    def add_loss(self, start: int, profile: np.ndarray, kind: str | None) -> None:
        """Add a log-excess; label from the first to the last step it exceeds LABEL_Z sigmas."""
        profile = profile[: self.n - start]
        self.loss_ex[start : start + len(profile)] += profile
        if kind:
            over = np.flatnonzero(profile > LABEL_Z * self.sigma[start : start + len(profile)])
            if len(over):
                self.mark(start + over[0], start + over[-1] + 1, kind)

    def spike_size(self, at: int, lo: float = SPIKE_MIN, z_min: float = SPIKE_Z_MIN) -> float:
        """Log size of a problem spike: above every benign blip, below the ceiling."""
        low = max(math.log(lo), z_min * float(self.sigma[at]))
        top = max(low, min(math.log(SPIKE_MAX), math.log(LOSS_CEILING) - self.log_trend[at]))
        return float(self.rng.uniform(low, top))  # log-uniform ratio: small ones as common


def spike_profile(rng: np.random.Generator, size: float = 1.0, persistent: bool = False):
    """A sudden jump of ``size`` that heals at once, decays, or sits on a plateau first.

    ``persistent``: it stays at >= 70 % of its size for at least 5 steps.
    """
    shape = (
        rng.choice(["decay", "plateau"])
        if persistent
        else rng.choice(["transient", "decay", "plateau"], p=[0.3, 0.4, 0.3])
    )
    if shape == "transient":
        return np.full(int(rng.integers(1, 3)), size)
    tau = loguniform(rng, 15 if persistent else 3, 150)
    hold = int(loguniform(rng, 5, 300)) if shape == "plateau" else 1
    low = 0.7 if persistent else 0.6
    level = size * rng.uniform(low, 1.0) if shape == "plateau" else size
    head = np.full(hold, level)
    head[0] = size
    profile = np.concatenate([head, level * np.exp(-np.arange(int(6 * tau) + 1) / tau)])
    if rng.random() < 0.4:  # some runs never quite get back: a residual that fades slowly
        residual = rng.uniform(0.05, 0.25) * level
        profile = np.maximum(profile, residual * np.exp(-np.arange(len(profile)) / (3 * tau)))
    return profile


def sudden_spike(c: Canvas) -> None:
    for _ in range(_count(c, per=1500, most=7)):
        # A third stay up: those may be as small as a big blip at first (x1.5, 12 sigmas),
        # and only their persistence tells them apart (a detector may take a step more).
        persistent = c.rng.random() < 0.35
        for attempt in range(6):  # long shapes may not fit a short run: draw again
            unit = spike_profile(c.rng, persistent=persistent) if attempt < 5 else np.ones(1)
            start = c.place(len(unit))
            if start is not None:
                break
        else:
            return
        z_min = PERSISTENT_Z_MIN if persistent and attempt < 5 else SPIKE_Z_MIN
        profile = unit * c.spike_size(start, z_min=z_min)
        c.add_loss(start, profile, "sudden_spike")
        g = profile * c.rng.uniform(0.3, 1.5)
        c.grad_ex[start : start + len(g)] += g[: c.n - start]


def gradual_spike(c: Canvas) -> None:
    for _ in range(_count(c, per=2000, most=5)):
        rise, hold, fall = (
            int(loguniform(c.rng, a, b)) for a, b in ((20, 400), (1, 50), (20, 500))
        )
        start = c.place(rise + hold + fall)
        if start is None:
            return
        peak = math.log(loguniform(c.rng, max(1.3, math.exp(20 * c.sigma[start])), 4.0))
        up = peak * (np.arange(1, rise + 1) / rise) ** c.rng.uniform(1.0, 2.5)
        down = peak * (1 - np.arange(1, fall + 1) / fall) ** c.rng.uniform(0.7, 2.0)
        profile = np.concatenate([up, np.full(hold, peak), down]) * _wobble(
            c.rng, rise + hold + fall
        )
        c.add_loss(start, profile, "gradual_spike")
        _follow(c, start, profile, grad=(0.3, 1.5))


def divergence(c: Canvas) -> None:
    """The loss climbs and never comes back; sometimes it ends in NaN."""
    rise = int(loguniform(c.rng, 20, 600))
    length = min(c.n - c.earliest - 1, int(rise * c.rng.uniform(1.0, 2.5)))
    start = c.place(max(length, 1), after=0, at_end=True)
    if start is None:
        return
    peak = math.log(loguniform(c.rng, max(1.5, math.exp(20 * c.sigma[start])), 6.0))
    steps = np.arange(1, c.n - start + 1)
    profile = peak * (steps / rise) ** c.rng.uniform(1.0, 2.5) * _wobble(c.rng, len(steps))
    profile = np.minimum(profile, math.log(LOSS_CEILING) - c.log_trend[start:])
    c.add_loss(start, profile, "divergence")
    _follow(c, start, profile, grad=(0.5, 2.0))
    if c.rng.random() < 0.3:
        k = int(c.rng.integers(1, 31))
        _nonfinite(c, c.n - k, k, loss=True)


def oscillation(c: Canvas) -> None:
    for _ in range(_count(c, per=2500, most=4)):
        span, settle = int(loguniform(c.rng, 40, 600)), int(loguniform(c.rng, 10, 200))
        start = c.place(span + settle, before=80)
        if start is None:
            return
        amp = math.log(loguniform(c.rng, max(1.15, math.exp(12 * c.sigma[start])), 2.5))
        ramp = max(1, int(span * c.rng.uniform(0.05, 0.5)))
        t = np.arange(span + settle)
        env = amp * np.clip(t / ramp, 0, 1)
        escalate = c.rng.random() < 0.3
        after = np.arange(settle) / settle
        env[span:] = amp * (1 + after) if escalate else amp * (1 - after)
        if escalate:
            env[span + settle // 2 :] = amp * 2 * (1 - after[settle // 2 :])
        if c.rng.random() < 0.4:  # period 2: loss flip-flops step to step
            wave = np.where(t % 2 == 0, 1.0, -1.0)
        else:
            wave = np.sin(2 * np.pi * t / c.rng.uniform(3, 30) + c.rng.uniform(0, 2 * np.pi))
        offset = c.rng.uniform(0.3, 0.6)
        c.loss_ex[start : start + len(t)] += env * (offset + (1 - offset) * wave)
        over = np.flatnonzero(env > LABEL_Z * c.sigma[start : start + len(t)])
        if len(over):
            c.mark(start + over[0], start + over[-1] + 1, "oscillation")
        c.grad_ex[start : start + len(t)] += env * c.rng.uniform(1, 3) * (0.5 + 0.5 * wave)
        if c.rng.random() < 0.5:  # the learning rate was set too high a little before
            lead = int(c.rng.integers(0, 31))
            c.lr[max(0, start - lead) : start + len(t)] *= c.rng.uniform(2, 8)
            if lead:  # a cause a predictor may warn about, not an anomaly yet
                c.mark(start - lead, start, "precursor", label=False)


def non_finite(c: Canvas) -> None:
    for _ in range(_count(c, per=1200, most=8)):
        variant = c.rng.choice(["step", "grad", "burst"], p=[0.45, 0.25, 0.3])
        k = 1 if variant == "step" else int(c.rng.integers(1, 4 if variant == "grad" else 11))
        start = c.place(k, before=30, after=60)
        if start is None:
            break
        _nonfinite(c, start, k, loss=variant != "grad")
    if c.rng.random() < 0.35:  # the run blows up at the end: a steep climb, then NaN
        k = int(c.rng.integers(1, 21))
        climb = int(c.rng.integers(5, 41))
        start = c.place(climb + k, after=0, at_end=True)
        if start is not None:
            size = c.spike_size(start, lo=2.0)
            profile = size * (np.arange(1, climb + 1) / climb) ** 2
            c.add_loss(start, profile, "divergence")
            _follow(c, start, profile, grad=(1.0, 3.0))
            _nonfinite(c, start + climb, k, loss=True)


def grad_explosion(c: Canvas) -> None:
    """The gradient norm explodes, often after a slow climb; the loss follows a few steps later."""
    for _ in range(_count(c, per=2000, most=5)):
        pre = int(loguniform(c.rng, 10, 80)) if c.rng.random() < 0.6 else 0
        lag = int(c.rng.integers(1, 11))
        blows_up = c.rng.random() < 0.1  # ... or the loss goes NaN, and the trainer skips those
        for attempt in range(6):
            unit = spike_profile(c.rng) if attempt < 5 and not blows_up else np.ones(2)
            start = c.place(pre + lag + max(len(unit), 60), before=60)
            if start is not None:
                break
        else:
            return
        if pre:  # a precursor: not an anomaly yet, but a predictor can see it coming
            climb = math.log(c.rng.uniform(1.5, 4.0)) * (np.arange(1, pre + 1) / pre) ** 2
            c.grad_ex[start : start + pre] += climb
            c.update_ex[start : start + pre] += 0.5 * climb
            c.mark(start, start + pre, "precursor", label=False)
        t0 = start + pre
        jump = math.log(loguniform(c.rng, GRAD_EXPLOSION_MIN, 3000))
        grow = int(c.rng.integers(1, 11))
        g = np.concatenate(
            [jump + np.linspace(0, c.rng.uniform(0, 3), grow), jump * np.exp(-np.arange(60) / 8)]
        )
        if blows_up:
            g = g[:lag]
        c.grad_ex[t0 : t0 + len(g)] += g
        c.update_ex[t0 : t0 + len(g)] += g * c.rng.uniform(0.1, 0.5)
        c.mark(t0, t0 + (lag if blows_up else max(lag, grow)), "grad_explosion")
        if blows_up:
            _nonfinite(c, t0 + lag, int(c.rng.integers(1, 4)), loss=True)
            continue
        size = math.log(loguniform(c.rng, 1.3, SPIKE_MAX))
        profile = unit * min(size, math.log(LOSS_CEILING) - c.log_trend[t0 + lag])
        c.loss_ex[t0 + lag : t0 + lag + len(profile)] += profile
        over = np.flatnonzero(profile > LABEL_Z * c.sigma[t0 + lag : t0 + lag + len(profile)])
        if len(over):
            c.mark(t0, t0 + lag + over[-1] + 1, "grad_explosion")


def data_shift(c: Canvas, most: int = 3) -> None:
    """Benign: the data changes and the loss steps down (and its noise changes)."""
    for _ in range(int(c.rng.integers(1, most + 1))):
        ramp = 1 if c.rng.random() < 0.6 else int(c.rng.integers(2, 21))
        start = c.place(ramp, before=100, after=100)
        if start is None:
            return
        drop = math.log(c.rng.uniform(0.7, 0.95))
        profile = np.full(c.n - start, drop)
        profile[:ramp] = drop * np.arange(1, ramp + 1) / ramp
        c.loss_ex[start:] += profile
        c.log_grad[start:] += math.log(c.rng.uniform(0.8, 1.3))
        scale = c.rng.uniform(0.7, 1.3)
        c.noise[start:] *= scale
        c.sigma[start:] *= scale
        c.mark(start, start + max(ramp, 5), "benign_data_shift", label=False)


def eval_bumps(c: Canvas) -> None:
    """Benign: the first steps after an evaluation run a little high (and come later)."""
    every = int(c.rng.choice([100, 125, 200, 250, 500, 1000]))
    pause = c.rng.uniform(5, 120)
    for at in range(every, c.n - 3, every):
        c.pauses[at] = pause
        if c.rng.random() > 0.8 or c.busy[at : at + 3].any():
            continue
        z = c.rng.uniform(3, 8)
        sizes = [min(z * c.sigma[at], math.log(1.15))]
        for _ in range(int(c.rng.integers(0, 3))):
            sizes.append(sizes[-1] * c.rng.uniform(0.2, 0.6))
        c.loss_ex[at : at + len(sizes)] += sizes
        c.busy[at : at + len(sizes)] = True
        c.mark(at, at + len(sizes), "benign_eval_bump", label=False)


def _follow(c: Canvas, start: int, profile: np.ndarray, grad: tuple[float, float]) -> None:
    """The gradient (and update) norm rise with the loss excess."""
    stop = min(c.n, start + len(profile))
    c.grad_ex[start:stop] += profile[: stop - start] * c.rng.uniform(*grad)
    c.update_ex[start:stop] += profile[: stop - start] * c.rng.uniform(0, 0.5)


def _wobble(rng: np.random.Generator, n: int) -> np.ndarray:
    """A smooth random factor around 1: real climbs are not straight lines."""
    walk = np.cumsum(rng.normal(0, 1, n))
    walk -= np.linspace(0, walk[-1], n)  # starts and ends at 1
    return np.exp(rng.uniform(0, 0.3) * walk / (np.abs(walk).max() + 1e-12))


def _nonfinite(c: Canvas, start: int, k: int, loss: bool) -> None:
    for i in range(start, min(c.n, start + k)):
        if loss:
            value = c.rng.choice([math.nan, math.inf, -math.inf], p=[0.6, 0.3, 0.1])
            c.loss_nonfinite[i] = float(value)
            c.grad_nonfinite[i] = math.nan if c.rng.random() < 0.7 else math.inf
        else:
            c.grad_nonfinite[i] = math.inf if c.rng.random() < 0.6 else math.nan
    c.mark(start, start + k, "non_finite")


def _count(c: Canvas, per: int, most: int) -> int:
    """How many episodes to try: one, plus about one per ``per`` steps."""
    return min(most, 1 + int(c.rng.binomial(c.n // per, 0.7)))
