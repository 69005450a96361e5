"""The robust spread: 1.4826 x the median absolute deviation, one constant, two forms."""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter, deque

import numpy as np
import pytest

from spikeguard.processors.robust_stats import (
    MAD_TO_SIGMA,
    RollingMedian,
    robust_sigma,
    robust_sigma_array,
)


def test_the_constant_makes_the_mad_a_gaussian_sigma() -> None:
    # 1 / Phi^-1(3/4): the MAD of a unit normal, inverted, to four places.
    assert MAD_TO_SIGMA == 1.4826
    assert pytest.approx(1 / statistics.NormalDist().inv_cdf(0.75), abs=1e-4) == MAD_TO_SIGMA


def test_robust_sigma_ignores_an_outlier_and_takes_any_sized_collection() -> None:
    assert robust_sigma([1.0, 2.0, 3.0, 4.0, 1000.0]) == 1.4826 * 1.0
    assert robust_sigma(deque([3.0, 1.0, 2.0])) == 1.4826 * 1.0
    assert robust_sigma([5.0, 5.0, 5.0]) == 0.0
    with pytest.raises(statistics.StatisticsError):
        robust_sigma([])


def test_robust_sigma_around_a_given_center() -> None:
    # Deviations from 0 are 1, 2, 3: their median is 2.
    assert robust_sigma([1.0, -2.0, 3.0], center=0.0) == 1.4826 * 2.0


def test_the_python_and_numpy_forms_agree_to_the_bit() -> None:
    rng = np.random.default_rng(11)
    for n in (1, 2, 7, 100, 101):
        x = rng.standard_t(3, n) * 0.1 + 4.0
        assert robust_sigma_array(x) == robust_sigma(x.tolist()), n
    assert math.isnan(robust_sigma_array(np.array([1.0, math.nan])))


def test_update_keeps_says_true_only_when_the_values_from_its_rank_up_are_unchanged() -> None:
    rng = random.Random(5)
    window, rank = 50, 44
    med = RollingMedian(window)
    said = Counter()
    for i in range(5000):
        before = med.largest(window - rank)
        keeps = med.update_keeps(float(rng.randint(0, 40)), rank)  # many ties
        if keeps:
            assert med.largest(window - rank) == before, i
        said[keeps] += 1
    assert said[True] > 1000 and said[False] > 1000  # it is asked about both ways, and is of use
