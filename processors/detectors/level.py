"""Robust level monitor of the log-loss: one-step outliers, short spikes, slow rises.

Ported from the lab's prototype (``spikeguard.lab.proposed_rules``), which
beat the pipeline and every trainer rule on real loss curves. Two tests on
``y = log(loss)``, each one-sided (a drop is never an anomaly):

* **level** — the baseline is the median of the last ``window`` *accepted*
  points and the noise scale 1.4826 x their MAD, so a flagged point never
  inflates its own baseline (OLMo-core's rule lets it). A point at least
  ``z`` noise units AND ``min_ratio`` above the baseline is *elevated*, and so
  is a point ``double_ratio`` (x2) above it while the window is not full yet
  (metaseq's and llm-foundry's number: early in a run the spread holds the fast
  descent and z is unreliable; later a loss that doubles within its own noise,
  a small-batch MSE, stays quiet). The
  first elevated point is an ``OUTLIER`` (a batch-induced one-step jump: the
  answer is to skip that update, not to roll back); a second in a row is a
  ``SPIKE``; ``divergence_points`` in a row, or one point ``divergence_ratio``
  above the baseline, is a ``DIVERGENCE``. After ``relearn_after`` elevated
  points in a row the baseline starts over (a lasting level shift is the
  new normal, not an endless spike).
* **slow rise** — Page's CUSUM of each accepted point's excess over the
  *best* baseline level of the run (never forgotten) less an allowance of
  ``rise_allowance`` in log units, in noise units: ``S = max(0, S + excess)``;
  ``S > rise_h`` is a ``SLOW_RISE``. The streaming divergence test forgets its
  best level within a few hundred steps, so a rise over thousands of steps
  would be absorbed; a healthy plateau scatters around its best level and
  the allowance keeps its CUSUM at 0.

:meth:`judge` changes nothing; :meth:`learn` takes an accepted point (and
advances the CUSUM, which only accepted points feed); :meth:`advance` counts
elevated points. State is O(``window``) and round-trips through JSON types.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from typing import Any

# Result codes of LevelMonitor.judge.
OK, WARMUP, OUTLIER, SPIKE, DIVERGENCE, SLOW_RISE = range(6)
MAD_TO_SIGMA = 1.4826


def _kth_distance(s: list[float], med: float, h: int, k: int) -> float:
    """The ``k``-th smallest (1-based) of the distances from ``med`` to the sorted ``s``.

    Left of ``h`` they are ``med - s[h-1], med - s[h-2], ...`` and from ``h`` on
    ``s[h] - med, s[h+1] - med, ...``: both ascending, so this is the k-th of two
    merged sorted sequences, found by bisecting how many come from the left. The
    same values (same subtractions) as walking out from the middle.
    """
    n_left, n_right = h, len(s) - h
    lo, hi = max(0, k - n_right), min(k, n_left)
    while lo < hi:  # a: how many of the k come from the left
        a = (lo + hi) // 2
        if med - s[h - 1 - a] < s[h + k - a - 1] - med:  # left's next is below right's last
            lo = a + 1
        else:
            hi = a
    left = med - s[h - lo] if lo > 0 else -math.inf
    right = s[h + k - lo - 1] - med if k - lo > 0 else -math.inf
    return left if left > right else right


class LevelMonitor:
    """One signal's robust level state. Parameters as in :class:`~.statistical.LevelConfig`."""

    __slots__ = (
        "window", "min_values", "z", "min_rise", "double_rise", "divergence_points", "divergence_rise",
        "relearn_after", "rise_warmup", "rise_allowance", "rise_h",
        "_hist", "_sorted", "_elevated", "_best", "_cusum", "_seen",
    )

    def __init__(
        self, *, window: int, min_values: int, z: float, min_ratio: float, double_ratio: float,
        divergence_points: int,
        divergence_ratio: float, relearn_after: int, rise_warmup: int, rise_allowance: float,
        rise_h: float,
    ) -> None:
        self.window = window
        self.min_values = min_values
        self.z = z
        self.min_rise = math.log(min_ratio)
        self.double_rise = math.log(double_ratio)
        self.divergence_points = divergence_points
        self.divergence_rise = math.log(divergence_ratio)
        self.relearn_after = relearn_after
        self.rise_warmup = rise_warmup
        self.rise_allowance = math.log(rise_allowance)
        self.rise_h = rise_h
        self._hist: deque[float] = deque(maxlen=window)  # accepted points, oldest first
        self._sorted: list[float] = []  # the same, sorted
        self._elevated = 0  # elevated points in a row
        self._best = math.inf  # lowest baseline level of the run (never forgotten)
        self._cusum = 0.0
        self._seen = 0  # accepted points fed to the CUSUM

    def baseline(self) -> tuple[float, float] | None:
        """(median, robust sigma) of the accepted window, or None while too few are in."""
        s = self._sorted
        n = len(s)
        if n < self.min_values:
            return None
        h = n // 2
        med = s[h] if n % 2 else 0.5 * (s[h - 1] + s[h])
        # MAD without sorting: the distances to the median grow outwards on both
        # sides of it (two sorted sequences), so their (h+1)-th smallest is found by
        # bisection in O(log n), not by walking out from the middle (O(window) per step).
        last = _kth_distance(s, med, h, h + 1)
        mad = last if n % 2 else 0.5 * (_kth_distance(s, med, h, h) + last)
        return med, mad * MAD_TO_SIGMA

    def judge(self, y: float) -> tuple[int, float, float, float, float]:
        """(code, z, rise above the baseline, CUSUM after ``y`` if accepted, baseline median).

        z is the CUSUM for ``SLOW_RISE``; the median is NaN during warm-up.
        """
        base = self.baseline()
        if base is None:
            return WARMUP, 0.0, 0.0, self._cusum, math.nan
        med, scale = base
        rise = y - med
        z = rise / scale if scale > 0.0 else (math.inf if rise > 0.0 else 0.0)
        # While the window is not full yet its spread holds the run's fast early descent,
        # so z is unreliable: a doubling is elevated then whatever z says.
        young = len(self._sorted) < self.window
        if rise >= self.min_rise and (z >= self.z or (young and rise >= self.double_rise)):
            run = self._elevated + 1
            if run >= self.divergence_points or rise >= self.divergence_rise:
                return DIVERGENCE, z, rise, self._cusum, med
            return (OUTLIER if run == 1 else SPIKE), z, rise, self._cusum, med
        cusum = self._cusum
        if self._seen + 1 >= self.rise_warmup and scale > 0.0:
            best = med if med < self._best else self._best
            cusum = max(0.0, cusum + (y - best - self.rise_allowance) / scale)
            if cusum > self.rise_h:
                return SLOW_RISE, cusum, y - best, cusum, med
        return OK, z, rise, cusum, med

    def advance(self, code: int) -> None:
        """Count elevated points; start the baseline over after ``relearn_after`` in a row."""
        if code in (OUTLIER, SPIKE, DIVERGENCE):
            self._elevated += 1
            if self._elevated >= self.relearn_after:
                self._hist.clear()
                self._sorted.clear()
                self._elevated = 0
        else:
            self._elevated = 0

    def learn(self, y: float, judged: tuple[int, float, float, float, float]) -> None:
        """Accept ``y`` (judged not elevated): into the window, and the CUSUM moves on."""
        med = judged[4]
        if med == med:  # judged against a baseline (not in warm-up)
            self._seen += 1
            if med < self._best:
                self._best = med
            self._cusum = judged[3]
        hist, srt = self._hist, self._sorted
        if len(hist) == self.window:
            del srt[bisect_left(srt, hist[0])]
        hist.append(y)
        insort(srt, y)

    def state_dict(self) -> dict[str, Any]:
        return {"hist": list(self._hist), "elevated": self._elevated, "best": self._best,
                "cusum": self._cusum, "seen": self._seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._hist = deque((float(v) for v in state["hist"]), maxlen=self.window)
        self._sorted = sorted(self._hist)
        self._elevated = int(state["elevated"])
        self._best = float(state["best"])
        self._cusum = float(state["cusum"])
        self._seen = int(state["seen"])
