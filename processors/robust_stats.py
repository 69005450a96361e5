"""The one robust window: median, quantiles and extremes of the last ``window`` values.

In the style of river's ``stats`` (``update``/``get``). Every rolling median,
MAD or quantile in the detectors, the fusion and the Guard's local skip rule
is one of these. The robust spread of a whole sample (:func:`robust_sigma`,
1.4826 x its median absolute deviation) lives here too, for the offline tools.

The windows are small, bounded and cheap (plain floats, no numpy): the detectors call them on
every step, so an update costs about a microsecond. Round-trips through
``state_dict()`` / ``load_state_dict()`` as JSON types. (The exponentially
weighted pieces live inline in :mod:`.detectors.series`, where they are hot.)

>>> med = RollingMedian(3)
>>> for x in (1.0, 10.0, 2.0, 3.0):
...     med.update(x)
>>> med.get(), med.max(), med.values()
(3.0, 10.0, [10.0, 2.0, 3.0])
>>> med.quantile(0.0), med.quantile(1.0)
(2.0, 10.0)
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left, insort
from collections import deque
from typing import Any, Collection, Sequence

import numpy as np

#: Gaussian sigma over the median absolute deviation (1 / Phi^-1(3/4), to four places):
#: ``MAD_TO_SIGMA * MAD`` estimates the standard deviation of normal noise.
MAD_TO_SIGMA = 1.4826


def robust_sigma(values: Collection[float], center: float | None = None) -> float:
    """``MAD_TO_SIGMA`` x the median of ``|v - center|``; ``center`` defaults to the median of ``values``.

    Raises ``statistics.StatisticsError`` on no values.

    >>> robust_sigma([1.0, 2.0, 3.0, 4.0, 1000.0])
    1.4826
    """
    if center is None:
        center = statistics.median(values)
    return MAD_TO_SIGMA * statistics.median(abs(v - center) for v in values)


def second_difference_spread(medians: Sequence[float]) -> float | None:
    """``MAD_TO_SIGMA`` x the (upper) median size of the second differences of ``medians``,
    consecutive block medians oldest first: how far a block median moves about a local
    straight line, so that a trend drops out. Over sqrt(6), one median's sigma; over sqrt(3),
    a difference of two's. Blocks alike for a while (correlated batches, a slow wander) move it
    further than independent points would: that is in it. None with fewer than eight medians
    (six differences).

    >>> second_difference_spread([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    0.0
    """
    if len(medians) < 8:
        return None
    second = sorted(abs(a - 2.0 * b + c) for a, b, c in zip(medians, medians[1:], medians[2:]))
    return MAD_TO_SIGMA * second[len(second) // 2]


def robust_sigma_array(x: np.ndarray) -> float:
    """:func:`robust_sigma` of an array around its median, in numpy (the same number for the same values)."""
    return float(MAD_TO_SIGMA * np.median(np.abs(x - np.median(x))))


class RollingMedian:
    """Median (and max) of the last ``window`` values: a ring plus a sorted copy.

    The ring is a bounded deque (the oldest value is ``ring[0]``); keeping the
    sorted copy costs a bisect and two memmoves of a short list per update,
    no sorting.
    """

    __slots__ = ("window", "_ring", "_sorted")

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self._ring: deque[float] = deque(maxlen=window)
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._ring)

    def update(self, x: float) -> None:
        ring = self._ring
        if len(ring) == self.window:  # the deque drops ring[0]; so does the sorted copy
            s = self._sorted
            del s[bisect_left(s, ring[0])]
        ring.append(x)
        insort(self._sorted, x)

    def update_keeps(self, x: float, rank: int) -> bool:
        """``update(x)``, and whether the sorted values from position ``rank`` up are the same
        after it: a full window whose value out and value in both sort below that position.
        (Whatever reads only those, a high quantile or the largest values, need not look again.)"""
        ring, s = self._ring, self._sorted
        # Out at or below s[rank - 1], in below s[rank]: the values above shift down, then back.
        keeps = len(ring) == self.window and 0 < rank < len(s) and ring[0] <= s[rank - 1]
        keeps = keeps and x < s[rank]
        self.update(x)
        return keeps

    def get(self) -> float:
        """The median; NaN while empty."""
        s = self._sorted
        n = len(s)
        if n == 0:
            return math.nan
        h = n >> 1
        return s[h] if n & 1 else 0.5 * (s[h - 1] + s[h])

    def max(self) -> float:
        """Largest value in the window; NaN while empty."""
        return self._sorted[-1] if self._sorted else math.nan

    def min(self) -> float:
        """Smallest value in the window; NaN while empty."""
        return self._sorted[0] if self._sorted else math.nan

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (0 <= q <= 1), linear between order statistics; NaN while empty."""
        s = self._sorted
        n = len(s)
        if n == 0:
            return math.nan
        pos = q * (n - 1)
        i = int(pos)
        if i >= n - 1:
            return s[-1]
        return s[i] + (pos - i) * (s[i + 1] - s[i])

    def largest(self, k: int) -> list[float]:
        """The ``k`` largest values, ascending."""
        return self._sorted[len(self._sorted) - k :] if k > 0 else []

    def last(self) -> float:
        """The value added most recently; NaN while empty."""
        return self._ring[-1] if self._ring else math.nan

    def values(self) -> list[float]:
        """Oldest first."""
        return list(self._ring)

    def copy(self) -> RollingMedian:
        twin = RollingMedian(self.window)
        twin._ring = self._ring.copy()
        twin._sorted = self._sorted.copy()
        return twin

    def clear(self) -> None:
        self._ring.clear()
        self._sorted = []

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clear()
        for x in state["values"][-self.window :]:
            self.update(float(x))
