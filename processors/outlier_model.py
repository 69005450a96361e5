"""The outlier-and-level model of one training signal (loss or gradient norm).

One model, used by the Guard's local skip (:mod:`spikeguard.producers.skip_rule`)
and by the pipeline's level test (:mod:`spikeguard.processors.detectors.level`):
same code, same thresholds, so a backtest says what the live run would do.
Plain Python, no numpy or torch: it runs in the trainer on every step.

Everything happens on ``y = log(x)``, so the thresholds are scale-free
(:func:`position` gives ``y``; an exact zero has none and is passed over). A
loss that goes below zero (a Poisson or Gaussian NLL, an ELBO) has no natural
zero, so no ratio means anything for it: its first negative value starts a
**signed** model (:attr:`OutlierModel.signed`) on ``y = x`` itself, judged by
its tail alone (no floor in log units; a power-law tail allowed for, see
:class:`TailThreshold`), and only once the tail has settled: with no ratio to
fall back on, a young tail's guess is not enough. The consumers start it over
at that step (:func:`turns_signed`).

* **level** — the median of the last ``level_window`` *accepted* points. A
  point judged elevated is not accepted: a spike cannot raise its own baseline.
* **residual** ``r = y - level``, taken before ``y`` joins anything.
* **tail** — the residuals of the last ``tail_window`` *healthy* points: a
  point over the threshold (elevated, or one a learning-rate jump excused) never
  joins it, so a spike the run healed from is not taken for heavy-tailed noise
  and cannot raise the bar for the next one (nor, through a spike of many
  points, ratchet the threshold up: a tail of values capped at the threshold
  would). Leaving them out truncates the tail only beyond the threshold, at
  the target rate (1e-5), which moves its 90th and 99th percentiles by about
  that fraction of a quantile: no feedback loop, unlike a MAD over accepted
  points with a bar at a few sigma. Noise that grows still teaches the tail, since
  most of its points stay under the bar, each raising the percentiles a little.
  Until the tail has *settled* (``settle`` values) it does not know the run's
  noise yet, and a small batch's first hard batches are over a bar fitted on a
  few dozen values: then every point joins, capped at the bar.
* **lag** — a residual joins the tail ``tail_lag`` steps late: a climb is
  judged against the noise from before it, not against its own first steps.
* **threshold** — ``q99 + s * ln(0.01 / rate)`` with ``s = (q99 - q90) / ln 10``:
  an exponential tail fitted through two empirical quantiles (peaks over
  threshold with a generalised Pareto shape of 0, as SPOT does; Siffer et al.,
  KDD 2017), extrapolated to the target false-alarm ``rate``. For any noise
  whose upper tail in log space is at most exponential, a healthy step is over
  it with probability at most about ``rate``; Gaussian noise, chi-square
  batch-1 MSE and cross-entropy with label noise have lighter tails in log
  space and stay far below. The default ``rate`` of 1e-5 is **one elevated
  point per 100,000 healthy steps at most**, per signal. A power-law tail
  (Student-t step noise) is passed far more often; once the tail is full
  (``tail_shape_from``) the exponential takes the generalised Pareto shape the
  tail's top tenth shows beyond one standard error (:func:`tail_shape`, 0 for a
  light tail, whose bar stays to the bit), which takes part of that back.
* **floor** — never below ``min_rise`` (log units): a run whose noise is tiny
  must not call a wobble of a few percent an outlier.
* **warm-up** — nothing is judged until the tail holds ``min_history``
  residuals; until it holds ``settle`` the floor is ``young_min_rise`` (few
  points give a poor tail estimate).
* **level shift** — after ``relearn_after`` elevated points in a row the level
  starts over from the points that come next: a lasting change is the new normal.
  A move up small against the noise makes no such run: it lifts only the noise's
  upper part over the bar, so elevated and healthy points interleave, and the level
  (which takes the healthy ones alone, censored at the bar) lags for hundreds of
  steps. With ``follow_elevated`` set (the Guard's skip rule sets it), that many
  elevated points among the last ``follow_window``, not all in one run, are no
  isolated outlier (a healthy point is elevated with probability ``rate``: three
  of them in twenty, at 1e-5, about 1e-12): the level moves up to the median of
  the points since the first of them, the low ones too (a median: a minority of
  spikes among them barely moves it; the points before the first are the old
  level's). Off for the pipeline's level test, whose own proportion test
  moves the level (:meth:`OutlierModel.move_level`) and tells a shift from a
  climb, which interleaves in the same way and must stay elevated.
* **learning rate** — for ``lr_grace`` steps after the learning rate jumped
  (``lr_rise`` times the lowest of the last ``lr_jump_steps`` steps, which were
  not rising: a warm
  restart), a rise is explained: nothing is elevated and every point is
  accepted. A warm-up raises the LR too slowly to count: an instability
  during the warm-up is still found. A jump to more than ``lr_rise`` times the
  highest LR the run had trained at is no warm restart (a restart returns to a
  rate the run knows): the rise is still explained, not elevated, and the
  judgement says so while the LR stays up (:attr:`Judged.lr_beyond_peak`), so that the pipeline can
  answer an LR-induced rise with the LR rather than with a rollback. Whether the
  loss rose after such a jump is judged against the level at the jump (the
  level itself takes the explained points in): the median of the last
  ``lr_jump_steps`` points since the jump over it by more than the noise's
  spread (the tail's median to its 90th percentile, at least ``min_rise``) is
  a held rise (:attr:`Judged.lr_held_rise`), far below one point's threshold.

:meth:`OutlierModel.judge` changes nothing; :meth:`OutlierModel.advance` takes
the judged point into the model. State round-trips through JSON types.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from itertools import accumulate
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from spikeguard.processors.robust_stats import RollingMedian

_LN10 = math.log(10.0)


class TailThreshold:
    """The false-alarm-rate threshold of a window of healthy values (see the module docstring).

    The exponential tail goes through two empirical quantiles, ``low`` and ``high``
    (0.90 and 0.99 by default). A short window wants lower ones: its 99th
    percentile is its largest value or two. The caller gives it healthy values only.

    >>> tail = TailThreshold(window=1000, rate=1e-4)
    >>> for i in range(1000):
    ...     tail.update((i % 100) / 1000)  # uniform on [0, 0.1)
    >>> round(tail.quantile(0.99), 3), round(tail.threshold(), 3)
    (0.098, 0.116)
    """

    __slots__ = (
        "rate",
        "low",
        "high",
        "lag",
        "power",
        "power_from",
        "shape_from",
        "_values",
        "_waiting",
        "_threshold",
        "_reads_from",
    )

    def __init__(
        self,
        window: int,
        rate: float,
        low: float = 0.90,
        high: float = 0.99,
        lag: int = 0,
        power: bool = False,
        power_from: int = 0,
        shape_from: int = 0,
    ) -> None:
        if not 0.0 < rate < 1.0 - high:
            raise ValueError(f"rate must be in (0, {1.0 - high:g}), got {rate}")
        if not 0.0 < low < high < 1.0:
            raise ValueError(f"need 0 < low < high < 1, got low={low} high={high}")
        self.rate = rate
        self.low = low
        self.high = high
        #: values wait this many updates before they join: a climb is judged against the
        #: tail from before it, not against its own first steps
        self.lag = lag
        #: the tail may be a power law: the exponential goes through the quantiles' excess over
        #: the median in log space (see threshold)
        self.power = power
        #: once this many values are in (0: never), the tail may be a power law too
        self.power_from = power_from
        #: once this many values are in (0: never), the exponential gets the tail's own shape
        #: (tail_shape): a heavier tail than exponential, shown by its values, raises the bar
        self.shape_from = shape_from
        self._values = RollingMedian(window)
        self._waiting: deque[float] = deque()
        # threshold() at ``rate`` for the values as they are (None: not computed since they
        # changed): a step judges against it and then caps its residual at it, same values.
        self._threshold: float | None = None
        # The lowest sorted position that threshold read: a full window whose value in and value
        # out both sort below it has the same values from there up, and the same threshold.
        self._reads_from = 0

    def __len__(self) -> int:
        """Values seen, the waiting ones included (at most the window plus the lag)."""
        return len(self._values) + len(self._waiting)

    def quantile(self, q: float) -> float:
        return self._values.quantile(q)

    def threshold(self, rate: float | None = None) -> float:
        """The value a healthy point exceeds with probability about ``rate``; NaN while empty."""
        if not rate:
            if self._threshold is None:
                self._threshold = self.threshold(self.rate)
                self._reads_from = self._lowest_read()
            return self._threshold
        values = self._values
        n = len(values)
        lo, hi = values.quantile(self.low), values.quantile(self.high)
        tail_hi = 1.0 - self.high
        decades = math.log((1.0 - self.low) / tail_hi)
        power_from = self.power_from
        if self.power or 0 < power_from <= n:
            bar = power_law_bar(values.quantile(0.5), lo, hi, self.low, self.high, rate)
            if bar == bar:
                return bar
        shape_from = self.shape_from
        if 0 < shape_from <= n:
            k = int(n * (1.0 - self.low))
            shape = tail_shape(values.largest(k), lo)
            if shape > 0.0:  # the generalised Pareto through lo and hi, extrapolated to rate
                far = math.expm1(shape * math.log((1.0 - self.low) / rate))
                return lo + (hi - lo) * far / math.expm1(shape * decades)
        scale = (hi - lo) / decades
        return hi + scale * math.log(tail_hi / rate)

    def _lowest_read(self) -> int:
        """The lowest sorted position ``threshold`` reads (the quantiles' and the top values')."""
        n = len(self._values)
        low = 0.5 if self.power or 0 < self.power_from <= n else self.low
        lowest = int(low * (n - 1))  # (as RollingMedian.quantile finds its order statistic)
        if 0 < self.shape_from <= n:
            lowest = min(lowest, n - int(n * (1.0 - self.low)))
        return lowest

    def update(self, value: float) -> None:
        """Add ``value`` (after ``lag`` more updates, once a hundred are in)."""
        waiting = self._waiting
        waiting.append(value)
        # No lag before the tail holds a hundred values: a young tail needs them now.
        held = len(waiting)
        if held <= self.lag and held <= len(self._values) - 100:
            return
        if not self._values.update_keeps(waiting.popleft(), self._reads_from):
            self._threshold = None

    def state_dict(self) -> dict[str, Any]:
        return {"values": self._values.values(), "waiting": list(self._waiting)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._values.load_state_dict(state)
        self._threshold = None
        self._waiting = deque(float(v) for v in state["waiting"])


#: the shape up to which the probability-weighted-moment estimate is used (its variance grows
#: without bound as the shape nears 0.5; beyond 0.4 its lower end falls again)
_SHAPE_MAX = 0.4


def tail_shape(top: list[float], over: float) -> float:
    """The generalised Pareto shape the ``top`` values' (ascending) excesses over ``over`` (a
    high quantile) show beyond
    doubt: the probability-weighted-moment estimate (Hosking and Wallis, Technometrics 1987),
    at most ``_SHAPE_MAX``, less one standard error, and at least 0 (exponential).

    Shape 0 is the exponential tail the threshold assumes. A heavier tail (Student-t step
    noise in log space: 1/3 for 3 dof) makes the exponential's bar too low, but fifty
    excesses give the shape to about +-0.16 (one standard error): only what is left beyond
    that raises the bar, so a run whose healthy tail merely looks heavy keeps its bar near
    the exponential's (missing a spike costs more than skipping a healthy batch). Light
    tails (Gaussian noise, chi-square MSE) estimate below 0 and keep the exponential.

    >>> round(tail_shape([float(i) for i in range(50)], 0.0), 3)  # uniform: lighter than exponential
    0.0
    """
    k = len(top)
    if k < 10:
        return 0.0
    a0 = sum(top) / k - over
    # sum over j of (k - 1 - j) * excess_j: the j-th value is in k - 1 - j of the first k - 1
    # running sums (summed in C: this runs on the trainer's thread every step)
    a1 = (sum(accumulate(top[: k - 1])) / (k - 1) - over * k / 2) / k
    d = a0 - 2.0 * a1
    if not d > 0.0:
        return 0.0
    xi = min(2.0 - a0 / d, _SHAPE_MAX)
    if not xi > 0.0:
        return 0.0
    variance = (1 - xi) * (2 - xi) ** 2 * (1 - xi + 2 * xi * xi) / ((1 - 2 * xi) * (3 - 2 * xi) * k)
    return max(0.0, xi - math.sqrt(variance))


def power_law_bar(mid: float, lo: float, hi: float, low: float, high: float, rate: float) -> float:
    """The value exceeded with probability ``rate``, for a tail that may be a power law, given
    its median ``mid`` and its ``low`` and ``high`` quantiles ``lo`` and ``hi``; NaN when
    ``lo`` is not above the median (no scale to extrapolate in).

    Values that are not logs (a signed loss's residuals) can have a power-law tail, which an
    exponential through two quantiles underestimates by orders of magnitude (Student-t, 3 dof:
    x180 the rate). The excess over the median, in units of the low quantile's, has an
    exponential tail in log space; quantiles commute with that map, so the values stay as they
    are and only the extrapolation goes through it. Gaussian noise gets ~9 sigma instead of
    ~5.5: a safe side for a guard.
    """
    unit = lo - mid
    if not unit > 0.0:
        return math.nan
    decades = math.log((1.0 - low) / (1.0 - high))
    low_log, high_log = math.log(2.0), math.log1p((hi - mid) / unit)
    scale = (high_log - low_log) / decades
    return mid + unit * math.expm1(high_log + scale * math.log((1.0 - high) / rate))


class RecentValues:
    """The last ``window`` values (a learning rate's, per step), oldest first."""

    __slots__ = ("window", "_values", "_rise", "_bar")

    def __init__(self, window: int) -> None:
        self.window = window
        self._values: deque[float] = deque(maxlen=window)
        # What a value must reach to be a jump of ``_rise`` (None: no value is, the window rises
        # or holds one value), for the values as they are: a model asks twice a step (judge,
        # advance) and the values change once. ``_rise`` None: not worked out since they changed.
        self._rise: float | None = None
        self._bar: float | None = None

    def __len__(self) -> int:
        return len(self._values)

    def update(self, value: float) -> None:
        self._values.append(value)
        self._rise = None

    def jumped(self, value: float, rise: float) -> bool:
        """``value`` is ``rise`` times the lowest of the window, and the window was not rising.

        A warm restart lifts the LR at once after a decay or a plateau; a warm-up
        lifts it a little every step, from near zero, and is never a jump (its window's
        newest value is above its oldest), so an instability during a warm-up is judged.
        """
        if self._rise != rise:
            values = self._values
            # one value says nothing of where the LR was going
            falling = len(values) >= 2 and values[-1] <= values[0]
            self._bar = rise * min(values) if falling else None
            self._rise = rise
        bar = self._bar
        return bar is not None and value > 0.0 and value >= bar

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self._values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._values = deque((float(v) for v in state.get("values", ())), maxlen=self.window)
        self._rise = None


class OutlierConfig(BaseModel):
    """Settings of one signal's model; chosen on synthetic and AlgoPerf curves (docs/detection.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    level_window: int = Field(
        100, ge=3, le=4096, description="accepted points in the rolling median"
    )
    tail_window: int = Field(
        500, ge=100, le=65536, description="residuals of healthy points the tail is fitted on"
    )
    min_history: int = Field(
        10, ge=5, description="residuals in the tail before any point is judged"
    )
    tail_lag: int = Field(
        50,
        ge=0,
        le=4096,
        description="residuals join the tail this many steps late, so that a climb is judged "
        "against the noise from before it rather than teaching the tail its own steps",
    )
    settle: int = Field(
        300, ge=20, description="until the tail holds this many residuals, the rate is stricter"
    )
    rate: float = Field(
        1e-5,
        gt=0.0,
        lt=0.01,
        description="target false-alarm rate per healthy step (1e-5: one per 100,000 steps)",
    )
    min_rise: float = Field(
        0.05, ge=0.0, description="the threshold is at least this in log units (0.05: +5 %)"
    )
    young_min_rise: float = Field(
        math.log(1.5),
        ge=0.0,
        description="before the tail has settled the threshold is at least this (x1.5)",
    )
    power_tail: bool = Field(
        False,
        description="extrapolate the tail as a power law in the residual's excess over its median "
        "(TailThreshold), as a signed loss's is: Student-t step noise has one in log space too, "
        "where the exponential's bar is over ~50x the target rate (Guard skips of ~1 per 1,000 "
        "steps on 1-5 % t(3) noise). Off by default: on a young run its bar is so high that a "
        "poisoned batch at step 350 of a tiny real training is no longer skipped",
    )
    power_tail_from: int = Field(
        0,
        ge=0,
        description="once the tail holds this many healthy residuals, extrapolate it as a power "
        "law too (0: never). 500 (a full tail) takes the held-out NanoGPT runs from 0.099 % to "
        "0.005 % of steps flagged, but loses a real x1.52 spike (real spikes 18 -> 17 of 19): "
        "off by default (docs/detection.md, Known gaps)",
    )
    tail_shape_from: int = Field(
        500,
        ge=0,
        description="once the tail holds this many healthy residuals (500: full), the exponential "
        "takes the generalised Pareto shape its top tenth shows beyond one standard error "
        "(tail_shape; 0: never): a heavy-tailed run's bar rises by what its own healthy noise "
        "proves, a light-tailed run's stays (docs/detection.md)",
    )
    relearn_after: int = Field(
        200, ge=2, description="after this many elevated points in a row the level starts over"
    )
    follow_window: int = Field(
        20,
        ge=3,
        le=4096,
        description="points over which elevated points interleaved with healthy ones are seen",
    )
    follow_elevated: int = Field(
        0,
        ge=0,
        description="elevated points among the last follow_window, not one run, that move the "
        "level up to those points' median: a move too small for a run of elevated points "
        "(0: off; the pipeline's level test moves the level by its own proportion test)",
    )
    lr_rise: float = Field(
        1.5,
        gt=1.0,
        description="a learning rate this many times the lowest of the last lr_jump_steps steps "
        "is a jump (a warm restart; a warm-up is slower) that explains a rise for lr_grace steps; "
        "one to more than this times the highest LR the run trained at is no warm restart "
        "(Judged.lr_beyond_peak)",
    )
    lr_jump_steps: int = Field(10, ge=1, le=4096, description="steps over which an LR jump is seen")
    lr_grace: int = Field(
        200, ge=1, le=65536, description="steps after an LR jump during which nothing is elevated"
    )

    def model(self, signed: bool = False) -> OutlierModel:
        return OutlierModel(self, signed)


class Judged(NamedTuple):
    """What :meth:`OutlierModel.judge` says of one point."""

    #: judged at all (False during warm-up, while the level restarts, or when an LR rise explains it)
    judged: bool
    #: above the threshold
    elevated: bool
    #: log units above the level (0.0 when not judged)
    residual: float
    #: the threshold it was (or, when an LR rise explained it, would have been) compared with
    #: (log units; NaN during warm-up)
    threshold: float
    #: the level (log units; NaN while there is none)
    level: float
    #: an LR jump explains the point, and that jump took the LR beyond ``lr_rise`` times the
    #: highest rate the run had trained at: not a warm restart
    lr_beyond_peak: bool = False
    #: ... and the points since that jump are held above the level at the jump by more than
    #: the noise's spread
    lr_held_rise: bool = False

    @property
    def score(self) -> float:
        """Residual over threshold: 1.0 is at the threshold (0.0 when not judged)."""
        return self.residual / self.threshold if self.judged and self.threshold > 0.0 else 0.0


#: what a point that is not judged gets (also a zero, which has no log: see position)
NOT_JUDGED = Judged(False, False, 0.0, math.nan, math.nan)
_MIN_LEVEL = 10  # accepted points before a level exists (also after a restart)
_MIN_HELD = 3  # points since an LR jump before their median says the loss is held up


class OutlierModel:
    """One signal's level, tail and threshold (see the module docstring)."""

    __slots__ = (
        "config",
        "signed",
        "level",
        "newest_quarter",
        "tail",
        "lr_recent",
        "lr_peak",
        "excused",
        "jump_peak",
        "jump_level",
        "since_jump",
        "elevated_run",
        "recent",
        "_grown",
    )

    def __init__(self, config: OutlierConfig | None = None, signed: bool = False) -> None:
        self.config = config or OutlierConfig()
        #: judged on the value itself, not its log (a loss that went below zero; module docstring)
        self.signed = signed
        self.level = RollingMedian(self.config.level_window)
        # The newest quarter of the level's points: below the whole window's, the loss is falling.
        self.newest_quarter = RollingMedian(max(1, self.config.level_window // 4))
        self.tail = TailThreshold(
            self.config.tail_window,
            self.config.rate,
            lag=self.config.tail_lag,
            power=signed or self.config.power_tail,
            power_from=self.config.power_tail_from,
            shape_from=self.config.tail_shape_from,
        )
        self.lr_recent = RecentValues(self.config.lr_jump_steps)
        # The highest learning rate the run has trained at (0.0: none seen yet; None: unknown,
        # a state saved before it was kept, and then no jump is taken for one beyond it).
        self.lr_peak: float | None = 0.0
        self.excused = 0  # steps left during which an LR jump explains a rise
        # The run's peak LR before that jump, when the jump went beyond it (None: it did not)
        self.jump_peak: float | None = None
        self.jump_level: float | None = None  # the level when it did (None: no such jump)
        self.since_jump = RollingMedian(self.config.lr_jump_steps)  # the newest points since
        self.elevated_run = 0  # elevated points in a row so far
        # The last follow_window judged points: (position, elevated), oldest first (none kept
        # while follow_elevated is off: the pipeline holds many models per run).
        kept = self.config.follow_window if self.config.follow_elevated else 0
        self.recent: deque[tuple[float, bool]] = deque(maxlen=kept)
        # The tail holds ``settle`` and ``min_history`` residuals. It only grows (a window full,
        # one joins as one leaves) until a state is loaded: once true, the counts need no asking.
        self._grown = False

    @property
    def settled(self) -> bool:
        """The tail holds ``settle`` residuals: its threshold is the run's own, no longer young."""
        return self._grown or len(self.tail) >= self.config.settle

    @property
    def min_rise(self) -> float:
        """The smallest rise that counts, in ``y`` units: ``min_rise`` (none for a signed value)."""
        return 0.0 if self.signed else self.config.min_rise

    def threshold(self) -> float:
        """The current threshold in ``y`` units (NaN during warm-up)."""
        cfg = self.config
        settled = self._grown
        if not settled:
            held = len(self.tail)
            if held < (cfg.settle if self.signed else cfg.min_history):
                return math.nan
            settled = held >= cfg.settle
            self._grown = settled and held >= cfg.min_history
        t = self.tail.threshold()
        if self.signed:
            return t
        floor = cfg.min_rise if settled else cfg.young_min_rise
        return t if t > floor else floor

    def current_level(self) -> float:
        """The level at the point being judged (log units; NaN while there is none).

        The median of a window sits at the window's middle, half a window behind a
        falling loss: every residual would be shifted down by the fall, the tail would
        learn that shift as the noise, and ordinary noise would be elevated once the fall
        slows. While the newest quarter of the window is lower, its median is the level
        (an eighth of a window behind, and right soon after a benign drop). A rise never
        shortens the window: a climb is judged against the level from before it.
        """
        whole = self.level.get()
        newest = self.newest_quarter.get()
        return newest if newest < whole else whole

    def _lr_jumped(self, lr: float | None) -> bool:
        if lr is None or not math.isfinite(lr):
            return False
        return self.lr_recent.jumped(lr, self.config.lr_rise)

    def _beyond(self, lr: float, peak: float | None) -> bool:
        return peak is not None and peak > 0.0 and lr > self.config.lr_rise * peak

    def lr_explains_rise(self, lr: float | None) -> bool:
        """Whether a recent jump of the learning rate (this step's included) explains a rise."""
        return self.excused > 0 or self._lr_jumped(lr)

    def lr_beyond_peak(self, lr: float | None) -> bool:
        """Whether the LR jump that explains a rise (this step's, or the recent one) took the LR
        beyond ``lr_rise`` times any rate the run had trained at (no warm restart), and ``lr`` is
        still there: once the schedule's jump is over, the LR is no longer what raises the loss."""
        return self._beyond_peak(lr, self._lr_jumped(lr))

    def _beyond_peak(self, lr: float | None, jumped: bool) -> bool:
        """lr_beyond_peak, given whether ``lr`` is a jump (``_lr_jumped``)."""
        if jumped:
            return self._beyond(lr, self.lr_peak)  # type: ignore[arg-type]  # a jump has an lr
        if lr is None or not math.isfinite(lr):
            return False
        return self.excused > 0 and self._beyond(lr, self.jump_peak)

    def _held_rise(self, y: float) -> bool:
        """The points since a jump beyond the peak LR (``y`` the newest) are held above the
        level at the jump by more than the noise's spread (see the module docstring)."""
        jump_level, since = self.jump_level, self.since_jump
        if jump_level is None or len(since) + 1 < min(_MIN_HELD, since.window):
            return False
        median = statistics.median(since.values()[1 - since.window :] + [y])  # newest, y included
        spread = self.tail.quantile(0.9) - self.tail.quantile(0.5)
        return median - jump_level > max(spread, self.min_rise)

    def judge(self, y: float, lr: float | None = None) -> Judged:
        """Judge ``y`` (a finite :func:`position`) against what came before; changes nothing."""
        if len(self.level) < _MIN_LEVEL:
            return NOT_JUDGED
        level = self.current_level()
        residual = y - level
        threshold = self.threshold()
        if threshold != threshold:
            return Judged(False, False, residual, math.nan, level)
        jumped = self._lr_jumped(lr)  # (asked once: both questions below need it)
        if self.excused > 0 or jumped:  # lr_explains_rise: not judged; the threshold is kept
            beyond = self._beyond_peak(lr, jumped)  # for who asks how far out it was
            return Judged(
                False,
                False,
                residual,
                threshold,
                level,
                beyond,
                beyond and self.excused > 0 and self._held_rise(y),
            )
        return Judged(True, residual > threshold, residual, threshold, level)

    def advance(self, y: float | None, judged: Judged, lr: float | None = None) -> None:
        """Take the judged point in: its residual into the tail, and into the level unless elevated.
        ``y`` None (a zero, which has no log): only the step's learning rate is taken in."""
        if self._lr_jumped(lr):
            self.excused = self.config.lr_grace
            beyond = self._beyond(lr, self.lr_peak)  # type: ignore[arg-type]  # a jump has an lr
            self.jump_peak = self.lr_peak if beyond else None
            # This step's loss was computed before the jumped LR moved anything: the level
            # it was judged against is where the loss was.
            level = judged.level
            self.jump_level = level if beyond and level == level else None
            self.since_jump.clear()
        elif self.excused:
            self.excused -= 1
            if self.jump_level is not None and y is not None:
                self.since_jump.update(y)
            if not self.excused:
                self.jump_peak = self.jump_level = None
                self.since_jump.clear()
        if lr is not None and math.isfinite(lr):
            self.lr_recent.update(lr)
            if self.lr_peak is not None and lr > self.lr_peak:
                self.lr_peak = lr
        if y is None:
            return
        if self.config.follow_elevated:
            if judged.judged:
                self.recent.append((y, judged.elevated))
            elif judged.level == judged.level:  # an LR rise explains it: no move of the level
                self.recent.clear()
        # Only a healthy point's residual teaches a settled tail: not an elevated one, nor one
        # an LR jump excused that would have been. A young tail, which does not know the run's
        # noise yet, takes every point, capped at the bar (module docstring).
        residual, bar = judged.residual, judged.threshold
        if judged.level == judged.level:
            if not residual > bar:
                self.tail.update(residual)
            elif not self.settled:
                cap = self.tail.threshold()  # the tail's own bar, below the young floor
                self.tail.update(cap if cap < residual else residual)
        if judged.elevated:
            self.elevated_run += 1
            if self.elevated_run >= self.config.relearn_after:
                self.level.clear()
                self.newest_quarter.clear()
                self.elevated_run = 0
            else:
                self._follow_interleaved(judged.level)
            return
        self.elevated_run = 0
        self.level.update(y)
        self.newest_quarter.update(y)

    def _follow_interleaved(self, level: float) -> None:
        """Move the level up to the median of the last points when ``follow_elevated`` of them
        were elevated, interleaved with healthy ones (module docstring: level shift)."""
        recent = self.recent
        marks = [i for i, (_, elevated) in enumerate(recent) if elevated]
        needed = self.config.follow_elevated
        if not needed or len(marks) < needed or marks[-1] - marks[0] + 1 == len(marks):
            return  # too few, or one run of elevated points (a multi-step spike's)
        # The points since the first elevated one: the new level's, its low ones too (the
        # points before it are the old level's, and would hold the median back).
        since = list(recent)[marks[0] :]
        by = statistics.median(y for y, _ in since) - level
        recent.clear()
        if by > 0.0:
            self.move_level(by)

    def move_level(self, by: float) -> None:
        """Move the level by ``by`` (``y`` units): a sustained elevation judged a move of the
        data's level is the new normal at once, not after ``relearn_after`` elevated points.
        The window keeps its points, moved, so the level stays judged through the move."""
        for window in (self.level, self.newest_quarter):
            moved = [v + by for v in window.values()]
            window.clear()
            for v in moved:
                window.update(v)
        self.elevated_run = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "signed": self.signed,
            "level": self.level.state_dict(),
            "tail": self.tail.state_dict(),
            "lr_recent": self.lr_recent.state_dict(),
            "lr_peak": self.lr_peak,
            "excused": self.excused,
            "jump_peak": self.jump_peak,
            "jump_level": self.jump_level,
            "since_jump": self.since_jump.values(),
            "elevated_run": self.elevated_run,
            "recent": [[y, elevated] for y, elevated in self.recent],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.signed = bool(state.get("signed", False))
        self.tail.power = self.signed or self.config.power_tail
        self.level.load_state_dict(state["level"])
        self.newest_quarter.load_state_dict(state["level"])  # it keeps the newest values that fit
        self.tail.load_state_dict(state["tail"])
        self._grown = False
        self.lr_recent.load_state_dict(state.get("lr_recent", {}))
        peak = state.get("lr_peak")
        self.lr_peak = None if peak is None else float(peak)
        self.excused = int(state["excused"])
        jump_peak = state.get("jump_peak")
        self.jump_peak = None if jump_peak is None else float(jump_peak)
        jump_level = state.get("jump_level")
        self.jump_level = None if jump_level is None else float(jump_level)
        self.since_jump.clear()
        for value in state.get("since_jump", ()):
            self.since_jump.update(float(value))
        self.elevated_run = int(state["elevated_run"])
        self.recent.clear()
        for y, elevated in state.get("recent", ()):
            self.recent.append((float(y), bool(elevated)))


def log_of(x: float, floor: float = 1e-12) -> float:
    """log(x) of a finite value, clipped below at ``floor`` (a loss of 0 has a log too)."""
    return math.log(x if x > floor else floor)


def position(x: float, signed: bool, floor: float = 1e-12) -> float | None:
    """Where a finite value is judged: its log (:func:`log_of`), or itself once ``signed``.

    None for an exact zero of a positive signal: a hinge or triplet loss is zero on most
    batches once learnt, and so is its gradient; log 0 has no place on the scale, and through
    the floor each nonzero batch after it would read as a jump of ~25 log units. A zero says
    only that the batch taught nothing: it is neither judged nor learnt."""
    if signed:
        return x
    return None if x == 0.0 else log_of(x, floor)


def turns_signed(x: float, signed: bool) -> bool:
    """Whether ``x`` starts a signed model: the first finite value below zero of a signal that had
    none (a zero is still a loss's floor, and -inf a non-finite step: only a negative value shows
    the loss has no natural zero)."""
    return not signed and -math.inf < x < 0.0


def loss_config() -> OutlierConfig:
    """The loss model's defaults, the same for the Guard's skip and the pipeline's level test."""
    return OutlierConfig()


def grad_norm_config() -> OutlierConfig:
    """The gradient norm's defaults: heavier-tailed than the loss, so larger floors (x4; x6 young;
    real ResNet runs heal from a x74 jump to x3 the step after)."""
    return OutlierConfig(min_rise=math.log(4.0), young_min_rise=math.log(6.0))
