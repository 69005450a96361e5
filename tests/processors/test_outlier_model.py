"""The shared outlier model's tail threshold: computed once per state of its values."""

from __future__ import annotations

import numpy as np

from spikeguard.processors.outlier_model import TailThreshold


def test_the_kept_threshold_is_always_the_one_its_values_give() -> None:
    rng = np.random.default_rng(5)
    tail, twin = TailThreshold(window=200, rate=1e-5, lag=20), None
    for i, value in enumerate(np.abs(rng.standard_t(3, 2000)) * 0.05):
        tail.update(float(value))
        if len(tail) >= 10:
            # threshold() may return a kept value; threshold(rate) always computes afresh.
            assert tail.threshold() == tail.threshold(tail.rate)
            assert tail.threshold() == tail.threshold()
        if i == 1000:  # a reload replaces the values: nothing kept from before may survive
            twin = TailThreshold(window=200, rate=1e-5, lag=20)
            twin.threshold()
            twin.load_state_dict(tail.state_dict())
            assert twin.threshold() == tail.threshold()
