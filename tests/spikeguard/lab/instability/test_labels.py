"""The written label rule: behind the twin by more than the margin, for good."""

from __future__ import annotations

import math

from spikeguard.lab.instability.labels import loss_alarm, trailing_mean, unstable_steps


def test_trailing_mean():
    assert trailing_mean([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]


def test_alarm_needs_a_held_gap_not_a_blip():
    twin = [2.0] * 40
    blip = [2.0] * 10 + [5.0] + [2.0] * 29  # one bad step: the 20-step mean moves 0.15, not more
    assert loss_alarm(unstable_steps(blip, twin)) is None
    behind = [2.0] * 10 + [2.5] * 30
    flags = unstable_steps(behind, twin)
    assert flags.index(True) == 14  # the trailing mean is 0.5 x 5/15 > 0.15 behind from step 14
    assert loss_alarm(flags) == 14
    assert loss_alarm(unstable_steps([2.0] * 5 + [math.nan] * 15, [2.0] * 20)) == 5
