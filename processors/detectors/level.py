"""The pipeline's level test of the loss: outlier steps, spikes, divergences and slow rises.

Four parts, all on ``y = log(loss)`` and all one-sided (a drop is never an anomaly).
A loss that went below zero is judged on ``y = loss`` (a *signed* monitor, see
:mod:`~spikeguard.processors.outlier_model`): no ratio applies to it, so every
gate below that is a ratio (``spike_ratio``, ``divergence_ratio``, ``rise_min``)
gives way to the run's own noise.

* **elevated points** — the same :class:`~spikeguard.processors.outlier_model.OutlierModel`
  as the Guard's local skip rule, with the same defaults: a point above the
  run's own false-alarm-rate threshold is *elevated*. The first elevated point
  is an ``OUTLIER`` (a batch-induced one-step jump: the Guard skipped that
  update, nothing is rolled back), a second in a row a ``SPIKE``, and so is
  a first one ``spike_ratio`` above the level (beyond any benign one-step
  jump: real healthy runs have them up to x2);
  ``divergence_points`` in a row, or one point ``divergence_ratio`` above the
  level and ``divergence_score`` times its settled threshold (so a run whose
  own noise reaches x10 needs more; a young run's one point is a spike, which
  the policy's patience judges), a ``DIVERGENCE``.
* **rises** (:class:`RiseTest`) — every ``block`` accepted points, the median
  of the block is compared with the median of the block ``h`` blocks earlier,
  for each horizon ``h`` of ``horizons``. Each horizon's differences keep a
  :class:`~spikeguard.processors.outlier_model.TailThreshold` of their own
  (through their median and 90th percentile), so
  a rise must be larger than the run's own noise *and* drift have produced
  so far (a falling, stationary or slowly drifting loss calibrates its own
  bar), at a false-alarm rate of one per 10 million steps and horizon (a rise
  cuts the learning rate), and at least
  ``min_rise``. A rise while the learning rate has recently gone up (a warm
  restart) is explained and not judged. A rise is a ``SLOW_RISE``.

* **climbs** (:class:`ClimbTest`) — the median of the last ``climb_window``
  residuals against that same statistic's own past values (its empirical
  null, at ``climb_rate`` per step): a gradual divergence, found before a
  single point is elevated, and never the run's own slow wander, whose
  excursions are in the null. Said as a divergence.

* **where the loss is now** — an EW mean of the residuals (``recent_alpha``)
  and of their absolute deviations from it. ``raised`` says that mean is
  ``raise_z`` of its own standard errors above the level. The swing test's
  oscillation needs it (:mod:`.statistical`): swings that leave the loss where
  it was are noise growing (a warm-up's larger steps), not an instability. Both
  averages follow the run's current noise, whatever its size or shape.

There is no "best level ever reached": a rise is judged against the run's
recent past and its own history of rises, never against a level the run may
never come back to (which turned a stationary loss or a benign drift into an
endless slow rise).

:meth:`LevelMonitor.judge` changes nothing; :meth:`LevelMonitor.advance`
takes the judged point in. State round-trips through JSON types.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from enum import IntEnum
from typing import Any, Callable, NamedTuple

from spikeguard.processors.outlier_model import OutlierConfig, OutlierModel, TailThreshold
from spikeguard.processors.outlier_model import Judged as Point
from spikeguard.processors.robust_stats import second_difference_spread


_MEAN_DEVIATION_TO_SIGMA = math.sqrt(
    math.pi / 2.0
)  # sigma over mean absolute deviation, Gaussian noise


class LevelCode(IntEnum):
    OK = 0
    WARMUP = 1
    OUTLIER = 2
    SPIKE = 3
    DIVERGENCE = 4
    SLOW_RISE = 5
    CLIMB = 6
    #: a sustained elevation (a run of elevated points, or a climb) in proportion to the run's
    #: own level moves: the data's level moved, an alert at most
    SHIFT = 7


class BlockJudged(NamedTuple):
    """The rise test at the end of a block."""

    #: the largest rise over its threshold, across horizons
    score: float
    #: that rise (log units)
    rise: float
    #: a rise over its threshold, not explained by the learning rate, that has gone on rising
    #: past its first two blocks (a step of the data's level jumps, then stays flat)
    rising: bool
    #: the block's median (log units)
    median: float
    #: a rise over its threshold, not explained by the learning rate (continuing or not)
    over: bool = False


class LevelJudged(NamedTuple):
    """What :meth:`LevelMonitor.judge` says of one point."""

    code: LevelCode
    #: residual over threshold (elevated points) or rise over its threshold (slow rise)
    score: float
    #: log units above the level (elevated points) or the rise (slow rise)
    rise: float
    #: the outlier model's judgement, for advance
    point: Point
    #: the rise test's judgement, for advance (None unless this point ends a block)
    block: BlockJudged | None
    #: the short-run mean of the residuals after this point (NaN while there is no level)
    recent: float = math.nan
    #: the short-run mean absolute deviation of the residuals from it
    spread: float = math.nan
    #: that mean is ``raise_z`` of its own standard errors above the level: the loss is up
    raised: bool = False
    #: the climb statistic is over its bar at this point
    climbing: bool = False


class RiseTest:
    """Block medians of accepted points compared across ``horizons`` (see the module docstring)."""

    __slots__ = (
        "block",
        "horizons",
        "min_rise",
        "min_blocks",
        "rate",
        "_current",
        "_medians",
        "_tails",
        "_waiting",
        "_excused",
        "_since_excused",
        "_onset",
        "_onset_blocks",
    )

    def __init__(
        self,
        *,
        block: int,
        horizons: tuple[int, ...],
        min_rise: float,
        min_blocks: int,
        rate: float,
        history: int,
    ) -> None:
        self.block = block
        self.horizons = horizons
        self.min_rise = min_rise
        self.min_blocks = min_blocks
        self.rate = rate
        self._current: list[float] = []  # accepted points of the block being filled
        self._medians: list[float] = []  # the last max(horizons) + 1 block medians, oldest first
        # A few hundred differences (twice what a horizon needs to judge, at least): the tail
        # goes through their median and 90th percentile.
        self._tails = [
            TailThreshold(
                max(history, 2 * (min_blocks + h)), min(rate * block, 0.05), low=0.5, high=0.9
            )
            for h in horizons
        ]
        # A difference over h blocks joins its tail h blocks late, from the run's first block on:
        # the differences a rise is judged against all end before the span it measures begins,
        # so a slow rise never teaches its own bar (a tail through its median and 90th
        # percentile, extrapolated ~6x beyond them, would rise faster than the rise itself).
        self._waiting: list[deque[float]] = [deque() for _ in horizons]
        self._excused = False  # an LR rise explained a point of the current block
        # Blocks completed since the last one with an explained point: a horizon that
        # reaches back to (or before) it compares across the LR rise, and is not judged.
        self._since_excused = 1 << 30
        # Where the current rise over its bar began (None: the last block was not over it): the
        # higher median of its first two blocks. A step of the data's level crosses the bar
        # inside a block, whose median then mixes both levels and sits below the new one; a
        # step has at most one such block. A rise is a slow rise once the loss has gone on
        # rising past both.
        self._onset: float | None = None
        self._onset_blocks = 0  # blocks of the current rise over its bar so far

    def judge(
        self,
        y: float,
        explained: bool,
        min_rise: Callable[[], float | None] | None = None,
        further: Callable[[], float | None] | None = None,
    ) -> BlockJudged | None:
        """The rise test, when ``y`` ends a block; else None. ``min_rise``, asked at a block's
        end, may replace the test's own smallest rise (a signed loss's, which no ratio gives).
        ``further``, asked likewise, is how far a rise over its bar must have gone on rising
        past its first two blocks (None: no such condition, a rise over its bar is a slow rise)."""
        if len(self._current) + 1 < self.block:
            return None
        values = sorted(self._current + [y])
        n = len(values)
        median = values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])
        best_score, best_rise, over = 0.0, 0.0, False
        given = None if min_rise is None else min_rise()
        floor = self.min_rise if given is None else given
        for h, tail in zip(self.horizons, self._tails):
            if len(self._medians) < h or not self._judges(h, tail):
                continue
            rise = median - self._medians[-h]
            bar = max(tail.threshold(), floor)
            if rise / bar > best_score:
                best_score, best_rise = rise / bar, rise
            across_lr_rise = explained or self._excused or self._since_excused < h
            if rise > bar and not across_lr_rise:
                over = True
        rising = over
        needed = None if further is None or not over else further()
        if needed is not None:
            rising = (
                self._onset is not None
                and self._onset_blocks >= 2
                and median - self._onset > needed
            )
        return BlockJudged(best_score, best_rise, rising, median, over)

    def difference_sigma(self) -> float | None:
        """The run's own sigma of a difference of two block medians, from its last block
        medians (:func:`second_difference_spread` over sqrt(3)). None with fewer than eight."""
        spread = second_difference_spread(self._medians)
        return None if spread is None else spread / math.sqrt(3.0)

    def _judges(self, h: int, tail: TailThreshold) -> bool:
        """Whether horizon ``h``'s tail has seen enough of the run's wander to judge a rise:
        ``min_blocks`` differences, and ``h`` more (differences ``h`` blocks apart overlap: the
        first ``h`` of them hold about one span of the run)."""
        return len(tail) >= self.min_blocks + h

    def advance(
        self,
        y: float,
        judged: BlockJudged | None,
        explained: bool,
        min_rise: Callable[[], float | None] | None = None,
    ) -> None:
        """Take an accepted point in; at a block's end, its rises that are not over their bar
        join their tails (``min_rise`` as for :meth:`judge`)."""
        if judged is None:
            self._current.append(y)
            self._excused = self._excused or explained
            return
        median = judged.median
        given = None if min_rise is None else min_rise()
        floor = self.min_rise if given is None else given
        for h, tail, waiting in zip(self.horizons, self._tails, self._waiting):
            if len(self._medians) >= h:
                rise = median - self._medians[-h]
                # A rise over its bar is not the run's wander: it never widens the bar. The bar
                # is never under the smallest rise: tails fitted while the loss fell fast sit
                # below zero, and a loss that stopped falling (no rise) must still teach them.
                if not (self._judges(h, tail) and rise > max(tail.threshold(), floor)):
                    waiting.append(rise)
                if len(waiting) > h:
                    tail.update(waiting.popleft())
        self._medians.append(median)
        del self._medians[: -max(self.horizons)]
        self._since_excused = 0 if (self._excused or explained) else self._since_excused + 1
        self._current, self._excused = [], False
        if not judged.over:
            self._onset, self._onset_blocks = None, 0
            return
        self._onset_blocks += 1
        if self._onset is None:
            self._onset = median
        elif self._onset_blocks <= 2:
            self._onset = max(self._onset, median)

    def state_dict(self) -> dict[str, Any]:
        return {
            "current": list(self._current),
            "medians": list(self._medians),
            "tails": [t.state_dict() for t in self._tails],
            "waiting": [list(w) for w in self._waiting],
            "excused": self._excused,
            "since_excused": self._since_excused,
            "onset": self._onset,
            "onset_blocks": self._onset_blocks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._current = [float(v) for v in state["current"]]
        self._medians = [float(v) for v in state["medians"]]
        for tail, data in zip(self._tails, state["tails"]):
            tail.load_state_dict(data)
        for waiting, data in zip(self._waiting, state.get("waiting", [[] for _ in self._waiting])):
            waiting.clear()
            waiting.extend(float(v) for v in data)
        self._excused = bool(state["excused"])
        self._since_excused = int(state["since_excused"])
        onset = state.get("onset")
        self._onset = None if onset is None else float(onset)
        self._onset_blocks = int(state.get("onset_blocks", 0 if onset is None else 2))


class ClimbTest:
    """A climb: the median of the last ``window`` residuals is over its own empirical null.

    The statistic is the run's own: the median of ``window`` residuals in a row,
    and its bar is a :class:`~spikeguard.processors.outlier_model.TailThreshold`
    of that same statistic's past values (through their median and 90th
    percentile, at the false-alarm ``rate`` per step). Loss whose data
    difficulty wanders slowly gives runs of high residuals that no test
    assuming independent points can tell from a climb ("8 of 10 over the 90th
    percentile" fires hundreds of times per 20k healthy steps then); their
    medians are in the null the bar is fitted on, so only a climb beyond what
    the run's own wander has done at that time scale counts. Values join
    ``history // 2`` steps late (a climb is judged against the run from before it),
    never while over the bar (a climb does not raise its own bar), and nothing
    is judged until ``history`` // 2 of them are in: the null must have seen the
    run's wander. A median ignores the one spike in a window (the outlier model's).
    """

    __slots__ = ("window", "rate", "history", "_recent", "_tail")

    def __init__(self, *, window: int, rate: float, history: int) -> None:
        self.window = window
        self.rate = rate
        self.history = history
        self._recent: list[float] = []  # the last judged points' residuals, oldest first
        # Values join half a history late: a slow climb's statistic rises under its bar at
        # every step, and would otherwise teach the null its own rise (the bar, fitted through
        # the median and 90th percentile, rises ~9x as fast as they do).
        self._tail = TailThreshold(history, rate, low=0.5, high=0.9, lag=history // 2)

    def statistic(self, residual: float) -> float | None:
        """The median of the last ``window`` residuals, ``residual`` the newest (None: fewer)."""
        recent = self._recent[1 - self.window :] + [residual]
        if len(recent) < self.window:
            return None
        return statistics.median(recent)

    def bar(self, floor: float = 0.0) -> float:
        """The statistic's bar, at least ``floor`` (inf until the null holds ``history // 2``
        values). A null fitted while the loss fell fast has its bar below zero, where a loss
        that merely stopped falling would be a climb: a climb is a rise, at least ``floor``."""
        tail = self._tail
        return max(tail.threshold(), floor) if 2 * len(tail) >= self.history else math.inf

    def judge(self, residual: float | None, floor: float = 0.0) -> float:
        """The statistic over its bar (>= 1: a climb; 0.0 while it cannot be judged)."""
        if residual is None:
            return 0.0
        stat = self.statistic(residual)
        bar = self.bar(floor)
        if stat is None or bar == math.inf or stat <= 0.0:
            return 0.0
        return stat / bar if bar > 0.0 else math.inf

    def sigma(self) -> float | None:
        """The statistic's own standard deviation on the run's past (its null's median to 90th
        percentile, over 1.2816: a normal's), None until the null holds ``history // 2`` values:
        how far a median of ``window`` points moves against the level ``climb_lag`` points
        before it, the run's wander at that time scale included."""
        tail = self._tail
        if 2 * len(tail) < self.history:
            return None
        return (tail.quantile(0.9) - tail.quantile(0.5)) / 1.2816

    def advance(self, residual: float | None, floor: float = 0.0) -> None:
        """Take a point in (None: a point not judged, which starts the window over); its
        statistic joins the null unless it is over the bar (at least ``floor``): a value that is
        no climb always joins, so a null fitted on a fall learns the loss's floor."""
        if residual is None:  # (no lagged level yet, or a point not judged)
            self._recent.clear()
            return
        stat = self.statistic(residual)
        self._recent.append(residual)
        del self._recent[: -self.window]
        if stat is not None and not stat > self.bar(floor):
            self._tail.update(stat)

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self._recent), "tail": self._tail.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._recent = [float(v) for v in state.get("recent", ())]
        if "tail" in state:
            self._tail.load_state_dict(state["tail"])


class LevelMoves:
    """The largest move of the level over ``span`` judged points, within the last ``memory``,
    joining ``lag`` points late.

    The run's own level moves at the climb test's time scale: its wander, its falls, a
    shift of the data's level it took in. Only levels move it, and a level takes in only
    accepted points (or a move judged in proportion), so a spike or a divergence never
    widens it. A move joins ``lag`` points late, so that a staircase of moves (a climb the
    level followed) never excuses its own next step. Kept as maxima of blocks of ``span``
    points (``memory // span`` of them, and ``lag // span`` waiting).

    >>> moves = LevelMoves(span=2, memory=4)
    >>> for level in (0.0, 0.0, 0.1, 0.1):  # the level moved by 0.1 within 2 points
    ...     moves.update(level)
    >>> moves.largest()
    0.1
    >>> for level in (0.1, 0.1, 0.1, 0.1):  # 4 points later it is forgotten
    ...     moves.update(level)
    >>> moves.largest()
    0.0
    """

    __slots__ = ("span", "memory", "lag", "_levels", "_blocks", "_current", "_count")

    def __init__(self, *, span: int, memory: int, lag: int = 0) -> None:
        self.span = span
        self.memory = memory
        self.lag = lag
        self._levels: deque[float] = deque(maxlen=span + 1)  # the levels of the last span points
        # closed blocks' maxima, oldest first: the newest lag // span are still waiting
        self._blocks: deque[float] = deque(maxlen=max(1, memory // span) + lag // span)
        self._current = 0.0  # the largest move in the block being filled
        self._count = 0  # points in it

    def largest(self) -> float:
        """The largest ``|level - level span points before|`` remembered (0.0: none yet)."""
        waiting = self.lag // self.span
        if not waiting:
            return max(self._current, max(self._blocks, default=0.0))
        joined = len(self._blocks) - waiting
        return max((self._blocks[i] for i in range(joined)), default=0.0)

    def update(self, level: float) -> None:
        levels = self._levels
        levels.append(level)
        if len(levels) == levels.maxlen:
            move = abs(level - levels[0])
            if move > self._current:
                self._current = move
        self._count += 1
        if self._count >= self.span:
            self._blocks.append(self._current)
            self._current, self._count = 0.0, 0

    def clear(self) -> None:
        """Start the span over (the points are not consecutive any more); the maxima stay."""
        self._levels.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "levels": list(self._levels),
            "blocks": list(self._blocks),
            "current": self._current,
            "count": self._count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._levels.clear()
        self._levels.extend(float(v) for v in state.get("levels", ()))
        self._blocks.clear()
        self._blocks.extend(float(v) for v in state.get("blocks", ()))
        self._current = float(state.get("current", 0.0))
        self._count = int(state.get("count", 0))


class LevelMonitor:
    """The loss's outlier model, its episodes of elevated points, and the rise test."""

    __slots__ = (
        "model",
        "rises",
        "climb",
        "moves",
        "spike_rise",
        "divergence_points",
        "divergence_rise",
        "divergence_score",
        "recent_alpha",
        "raise_z",
        "_elevated",
        "_run",
        "_run_climbed",
        "_climbing",
        "_onset",
        "_latest",
        "_recent",
        "_spread",
        "_levels",
    )

    def __init__(
        self,
        *,
        outliers: OutlierConfig,
        signed: bool = False,
        spike_ratio: float,
        divergence_points: int,
        divergence_ratio: float,
        divergence_score: float,
        rise_block: int,
        rise_horizons: tuple[int, ...],
        rise_min: float,
        rise_min_blocks: int,
        rise_rate: float,
        rise_history: int,
        climb_window: int,
        climb_rate: float,
        climb_history: int,
        climb_lag: int,
        moves_memory: int,
        recent_alpha: float,
        raise_z: float,
    ) -> None:
        self.model = OutlierModel(outliers, signed)
        self.rises = RiseTest(
            block=rise_block,
            horizons=tuple(rise_horizons),
            min_rise=math.log(rise_min),
            min_blocks=rise_min_blocks,
            rate=rise_rate,
            history=rise_history,
        )
        self.climb = ClimbTest(window=climb_window, rate=climb_rate, history=climb_history)
        self.moves = LevelMoves(span=climb_lag, memory=moves_memory, lag=climb_history // 2)
        self.spike_rise = math.log(spike_ratio)
        self.divergence_points = divergence_points
        self.divergence_rise = math.log(divergence_ratio)
        self.divergence_score = divergence_score
        self.recent_alpha = recent_alpha
        self.raise_z = raise_z
        self._recent = math.nan  # EW mean of the residuals: where the loss is now, over its level
        self._spread = math.nan  # EW mean of their absolute deviations from it
        self._elevated = 0  # elevated points in a row
        self._run: list[
            float
        ] = []  # their residuals (a sustained elevation's size is their median)
        self._run_climbed: list[float] = []  # ... and their rises over the lagged level
        self._climbing = 0  # points in a row whose climb statistic was over its bar
        # The loss at the first climb_window points of the current elevation (a run of elevated
        # points, or a climb), and at the last climb_window judged points: a divergence has gone
        # on rising since it began; a step of the data's level jumped and stayed.
        self._onset: list[float] = []
        self._latest: deque[float] = deque(maxlen=climb_window)
        # The level at each of the last climb_lag judged points: a climb is measured from
        # the level before it, which by now has followed it part of the way.
        self._levels: deque[float] = deque(maxlen=climb_lag)

    def judge(self, y: float, lr: float | None = None, skipped: bool = False) -> LevelJudged:
        """Judge ``y``; ``skipped``: the trainer skipped this step's update itself."""
        judged = self._judge(y, lr, skipped)
        residual = judged.point.residual
        if judged.point.level != judged.point.level:
            return judged
        a = self.recent_alpha
        if self._recent != self._recent:
            return judged._replace(recent=residual, spread=0.0)
        spread = self._spread + a * (abs(residual - self._recent) - self._spread)
        recent = self._recent + a * (residual - self._recent)
        # The standard error of an EW mean of noise whose mean absolute deviation is
        # ``spread``: sigma = spread * sqrt(pi / 2) (exact for Gaussian noise, near it for others).
        standard_error = spread * _MEAN_DEVIATION_TO_SIGMA * math.sqrt(a / (2.0 - a))
        return judged._replace(
            recent=recent, spread=spread, raised=recent > self.raise_z * standard_error
        )

    def _judge(self, y: float, lr: float | None, skipped: bool) -> LevelJudged:
        point = self.model.judge(y, lr)
        signed = self.model.signed
        if not point.judged:
            code = LevelCode.WARMUP if point.level != point.level else LevelCode.OK
            block = (
                self.rises.judge(y, True, self._block_rise_floor, self._block_further)
                if code == LevelCode.OK
                else None
            )
            return LevelJudged(code, 0.0, point.residual, point, block)
        if point.elevated:
            run = self._elevated + 1
            # One point says "divergence" only against noise the run has shown: twice its own
            # settled threshold (a young tail has not seen its hard batches yet; the patience
            # judges a young spike). A signed loss has no ratio: its noise alone says. Nor
            # does one point whose update the trainer skipped: the weights never took it, and
            # the next points say whether the loss stays up (a heavy-tailed run's hard batch
            # does not; the policy's patience judges it as a spike). A signed loss's later
            # points say it only while the elevation goes on rising: its noise is its only
            # scale, and a harder stretch of its data is tens of those sigmas up and flat (a
            # positive loss's x10 is no stretch of data).
            far = (
                not skipped
                and (signed or point.residual >= self.divergence_rise)
                and point.score >= self.divergence_score
                and self.model.settled
                and (run == 1 or not signed or self._still_rising(y))
            )
            if far:
                code = LevelCode.DIVERGENCE
            elif run == 1:
                code = (
                    LevelCode.OUTLIER
                    if signed or point.residual < self.spike_rise
                    else LevelCode.SPIKE
                )
            elif not self.beyond_moves(self._elevation(y, point.residual)):
                code = LevelCode.SHIFT
            elif run >= self.divergence_points and self._still_rising(y):
                code = LevelCode.DIVERGENCE
            else:
                code = LevelCode.SPIKE
            return LevelJudged(code, point.score, point.residual, point, None)
        block = self.rises.judge(y, False, self._block_rise_floor, self._block_further)
        climbing = False
        if self.model.settled:
            climbed = self._climbed(y)
            climb = self.climb.judge(climbed, self._smallest_rise())
            if climb >= 1.0:
                # A climb is sustained: over its bar for a window's worth of points in a row.
                # Until then the test has said nothing (a mixture's run of hard batches lifts
                # one window's median for a step or three: no alarm, not even an alert).
                climbing = True
                if self._climbing + 1 >= self.climb.window:
                    stat = self.climb.statistic(climbed)  # type: ignore[arg-type]  # a value
                    beyond = self.beyond_moves(stat)  # type: ignore[arg-type]
                    code = LevelCode.CLIMB if beyond and self._still_rising(y) else LevelCode.SHIFT
                    return LevelJudged(code, climb, stat, point, block, climbing=True)  # type: ignore[arg-type]
        if block is not None and block.over:
            # A rise over its bar that has not gone on rising since its first block is where a
            # step of the data's level leaves the loss: an alert, until it rises further.
            code = LevelCode.SLOW_RISE if block.rising else LevelCode.SHIFT
            return LevelJudged(code, block.score, block.rise, point, block, climbing=climbing)
        return LevelJudged(
            LevelCode.OK, point.score, point.residual, point, block, climbing=climbing
        )

    def _elevation(self, y: float, residual: float) -> float:
        """A run of elevated points' size, ``y`` the newest: the median of their residuals, or of
        their rises over the level ``climb_lag`` points before it if larger (a staircase of
        moves, each small against the level it moved, is not small against where it began)."""
        elevation = statistics.median(self._run + [residual])
        climbed = self._climbed(y)
        if climbed is not None:
            elevation = max(elevation, statistics.median(self._run_climbed + [climbed]))
        return elevation

    def _climbed(self, y: float) -> float | None:
        """``y`` over the level ``climb_lag`` judged points ago (None: not that many yet)."""
        levels = self._levels
        return y - levels[0] if len(levels) == levels.maxlen else None

    def _still_rising(self, y: float) -> bool:
        """Whether the loss, ``y`` the newest point, has gone on rising since the current
        elevation began: the median of the last ``climb_window`` points is over the median of
        the elevation's first ones by :meth:`_further` (five standard errors of that difference).

        A divergence keeps rising; a step of the data's level jumps, then stays flat. Both lift
        the climb statistic (measured from the level before them) and keep points elevated, so
        neither size nor duration tells them apart, and a run's first step has no earlier move
        to be in proportion to. What a step never does is go on rising after its jump. True
        before the tail has settled (no spread yet: sustained elevation alone says, as it did).
        The bar is the run's own where its past shows more: a median of correlated points (a
        slow wander of a flat step's level) moves further than independent ones would, as far
        as the climb statistic's own past values moved (:meth:`ClimbTest.sigma`)."""
        further = self._further(self.climb.window, self.climb.sigma())
        if further is None:
            return True
        if not self._onset:
            return False
        latest = list(self._latest)[1 - self.climb.window :] + [y]
        return statistics.median(latest) - statistics.median(self._onset) > further

    def _back(self, climbed: float | None) -> bool:
        """Whether the loss, ``climbed`` over the level before it (None: not judged), is back at
        that level as the climb test measures it (its statistic at or under zero)."""
        above = None if climbed is None else self.climb.statistic(climbed)
        return above is None or above <= 0.0

    def _further(self, points: int, own_sigma: float | None = None) -> float | None:
        """How far a rise must have gone on rising since it began, to be a divergence rather
        than a step: five standard errors of a difference of two medians of ``points`` points.
        What independent points give: 1.38 / sqrt(points) of one point's median-to-q90 spread
        (a median is near that for any noise shape); or, where the run keeps that difference's
        own past (``own_sigma``), five of its sigmas if more: a median of correlated points (a
        loss whose batches are alike for a while, a slow wander) moves further than independent
        ones would, and the run's past shows how far. None before the tail has settled."""
        spread = self._point_spread()
        if spread is None:
            return None
        independent = 5.0 * 1.38 * spread / math.sqrt(points)
        return independent if own_sigma is None else max(independent, 5.0 * own_sigma)

    def _block_further(self) -> float | None:
        """:meth:`_further` for the rise test's block medians."""
        return self._further(self.rises.block, self.rises.difference_sigma())

    def _point_spread(self) -> float | None:
        """One point's noise spread: the tail's median to its 90th percentile (None: the tail
        has not settled, or has no spread)."""
        model = self.model
        if not model.settled:
            return None
        spread = model.tail.quantile(0.9) - model.tail.quantile(0.5)
        return spread if spread > 0.0 else None

    def beyond_moves(self, elevation: float) -> bool:
        """Whether a sustained elevation of ``elevation`` (``y`` units over the level) is well
        beyond the run's own level moves at that time scale: over the bar of the climb statistic
        (a median of ``climb_window`` points over the level, against its own past values: the
        run's wander at that scale), over ``divergence_score`` times the largest move of the
        level the run took in (:class:`LevelMoves`: the rare large moves, earlier shifts, that
        a tail through its median and 90th percentile never sees), and at least the rise test's
        smallest rise. One inside them is the data's level moving: an alert at most; a spike or
        a divergence needs more. A signed loss, which has no ratio, has no proportion before its
        climb null has seen the run."""
        floor = self._smallest_rise()
        if elevation < floor:
            return False
        bar = self.climb.bar(floor)
        if bar == math.inf and self.model.signed:  # no ratio, and no history yet: no proportion
            return False
        # Over the climb's own bar (its null is already the run's wander at that scale), and
        # over twice the largest level move the run took in.
        known = bar if bar < math.inf else 0.0
        return elevation > max(known, self.divergence_score * self.moves.largest())

    def _smallest_rise(self) -> float:
        """The smallest rise any test counts: the rise test's ratio, or a signed loss's floor."""
        floor = self._rise_floor()
        return self.rises.min_rise if floor is None else floor

    def _rise_floor(self) -> float | None:
        """A signed loss's smallest rise: the spread of its points' own noise (the tail's median
        to its 90th percentile; no rise before the tail has settled). A block median moves far
        less than one point, so a rise of the loss's level by that much is no drift of noise,
        and a loss that stops falling is no rise. None: the test's ratio (a positive loss)."""
        model = self.model
        if not model.signed:
            return None
        if not model.settled:
            return math.inf
        spread = model.tail.quantile(0.9) - model.tail.quantile(0.5)
        return spread if spread > 0.0 else math.inf

    def _block_rise_floor(self) -> float | None:
        """The rise test's smallest rise: as :meth:`_rise_floor`, and for a positive loss whose
        tail has settled, at least the spread of one point's noise (the tail's median to its
        90th percentile). A difference of two block medians has ~0.2 of that spread's noise, so
        a rise of one point's spread is ~5 standard errors for any noise: a loss sitting still
        on noise of 18 % is no rise, even while its tails still hold a fall the run has left
        (a difference over h blocks joins them h blocks late)."""
        floor = self._rise_floor()
        model = self.model
        if floor is not None or not model.settled:
            return floor
        spread = model.tail.quantile(0.9) - model.tail.quantile(0.5)
        return max(self.rises.min_rise, spread)

    def advance(self, y: float, judged: LevelJudged, lr: float | None = None) -> None:
        point = judged.point
        # An elevated point is the outlier model's; one not judged (an LR rise) starts over.
        climbed = self._climbed(y)  # (before this point's level joins the lagged ones)
        # (an elevated point inside a climb is the climb going on, not its end)
        climbing = judged.climbing or (point.elevated and self._climbing > 0)
        # An elevation begins with an elevated point or a climb over its bar, and goes on until
        # the loss is back at the level before it (a climb's statistic dips under its bar
        # without the climb being over); a run of elevated points in proportion ends it: the
        # level moves to it. (The climb statistic is asked before this point joins it.)
        if (point.elevated and judged.code == LevelCode.SHIFT) or not (
            point.elevated
            or climbing
            or (self._onset and not self._back(climbed if point.judged else None))
        ):
            self._onset = []
        elif point.elevated and not self._elevated and not climbing:
            # A jump starts a run of elevated points outside a climb: its elevation begins
            # here. The points of an earlier elevation not yet back at its level would count
            # the jump itself as "still rising" (a flat step up on a wandering loss).
            self._onset = [y]
        elif len(self._onset) < self.climb.window:
            self._onset.append(y)
        self._latest.append(y)
        if point.judged and not point.elevated and self.model.settled:
            self.climb.advance(climbed, self._smallest_rise())
        elif not point.elevated:
            self.climb.advance(None)
            self._levels.clear()
        if point.judged and not point.elevated:
            self._levels.append(point.level)
        self._climbing = self._climbing + 1 if climbing else 0
        self.model.advance(y, point, lr)
        # (from the settled tail on: a run's first hundreds of points fall far faster than any
        # move of its data's level, and would excuse any elevation after them)
        if point.level == point.level and self.model.settled:
            self.moves.update(self.model.current_level())
        if judged.recent == judged.recent:
            self._recent, self._spread = judged.recent, judged.spread
        if point.elevated and judged.code == LevelCode.SHIFT:
            # The data's level moved, in proportion: the level follows now (the climb test's
            # lagged levels do not: a staircase of such moves is still a climb).
            self.model.move_level(statistics.median(self._run + [point.residual]))
            self._elevated, self._run, self._run_climbed = 0, [], []
        elif point.elevated:
            self._elevated += 1
            self._run.append(point.residual)
            if climbed is not None:
                self._run_climbed.append(climbed)
        else:
            self._elevated, self._run, self._run_climbed = 0, [], []
        if point.elevated or judged.code == LevelCode.WARMUP:
            return
        self.rises.advance(y, judged.block, not point.judged, self._block_rise_floor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "rises": self.rises.state_dict(),
            "climb": self.climb.state_dict(),
            "moves": self.moves.state_dict(),
            "levels": list(self._levels),
            "elevated": self._elevated,
            "run": list(self._run),
            "run_climbed": list(self._run_climbed),
            "climbing": self._climbing,
            "onset": list(self._onset),
            "latest": list(self._latest),
            "recent": self._recent,
            "spread": self._spread,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.rises.load_state_dict(state["rises"])
        self.climb.load_state_dict(state.get("climb", {}))
        self.moves.load_state_dict(state.get("moves", {}))
        self._levels.clear()
        self._levels.extend(float(v) for v in state.get("levels", ()))
        self._elevated = int(state["elevated"])
        self._run = [float(v) for v in state.get("run", ())]
        self._run_climbed = [float(v) for v in state.get("run_climbed", ())]
        self._climbing = int(state.get("climbing", 0))
        self._onset = [float(v) for v in state.get("onset", ())]
        self._latest.clear()
        self._latest.extend(float(v) for v in state.get("latest", ()))
        self._recent = float(state.get("recent", math.nan))
        self._spread = float(state.get("spread", math.nan))
