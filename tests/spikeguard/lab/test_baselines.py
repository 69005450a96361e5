"""The baselines follow their specified rules exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spikeguard.lab.baselines import NaiveBaseline, SixSigmaBaseline, flag_run
from spikeguard.lab.evaluation import Mark
from spikeguard.schemas import StepEvent


def ev(step: int, loss: float, grad: float | None = None) -> StepEvent:
    return StepEvent(run_id="b", step=step, loss=loss, grad_norm=grad, time=float(step))


def feed(baseline, losses, grads=None):
    grads = grads or [None] * len(losses)
    return [baseline.update(ev(i, l, g)) for i, (l, g) in enumerate(zip(losses, grads))]


def wobble(n: int, level: float = 2.0, amp: float = 0.01) -> list[float]:
    return [level + amp * (-1) ** i for i in range(n)]


class TestNaive:
    def test_no_alarm_during_the_ten_step_warm_up_except_non_finite(self):
        b = NaiveBaseline()
        flags = feed(b, [1.0] * 5 + [100.0, 1.0, math.nan, 1.0, 1.0])
        assert flags == [False] * 7 + [True, False, False]

    def test_z_score_alone_is_not_enough(self):
        b = NaiveBaseline()
        feed(b, wobble(20))
        # +40 %: z >> 2.5 (0.4) but no 50 % jump and a flat slope: score 0.4
        assert b.update(ev(20, 2.8)) is False and b.last_score == pytest.approx(0.4)

    def test_z_score_plus_jump_is_an_anomaly(self):
        b = NaiveBaseline()
        feed(b, wobble(20))
        assert b.update(ev(20, 3.2)) is True and b.last_score == pytest.approx(0.7)

    def test_jump_plus_slope_is_exactly_the_threshold_and_not_above(self):
        b = NaiveBaseline(z_threshold=1e9)  # isolate the other two rules
        feed(b, wobble(20))
        assert b.update(ev(20, 5.0)) is False and b.last_score == pytest.approx(0.5)

    def test_the_slope_rule_uses_the_last_five_losses(self):
        b = NaiveBaseline()
        feed(b, wobble(16) + [2.0, 2.8, 3.6, 4.4])  # a steep climb: slope/mean > 0.2
        before = b.last_score
        assert b.update(ev(20, 5.2)) is True
        assert before >= 0.6 and b.last_score == pytest.approx(0.6)  # z + slope, no 50 % jump

    def test_window_is_the_previous_twenty_losses(self):
        b = NaiveBaseline()
        feed(b, [5.0] * 10 + wobble(20))
        assert len(b.history) == 20 and max(b.history) < 3  # the 5.0s have left
        assert b.update(ev(30, 3.2)) is True

    def test_nan_stays_in_the_window_and_blinds_the_z_score(self):
        b = NaiveBaseline()
        feed(b, wobble(20))
        assert b.update(ev(20, math.nan)) is True
        feed(b, wobble(5))
        # x2.5 jump: the z-score is NaN (no 0.4), jump 0.3 + slope 0.2 = 0.5: not above 0.5
        assert b.update(ev(26, 5.0)) is False and b.last_score == pytest.approx(0.5)
        feed(b, wobble(25))  # once the NaN has left the window the z-score is back
        assert b.update(ev(52, 5.0)) is True and b.last_score == pytest.approx(0.9)

    def test_infinite_losses_are_anomalies(self):
        b = NaiveBaseline()
        feed(b, wobble(20))
        assert b.update(ev(20, math.inf)) and b.update(ev(21, -math.inf))


class TestSixSigma:
    def noisy(self, n: int, seed: int = 0) -> list[float]:
        return list(2.0 + 0.01 * np.random.default_rng(seed).standard_normal(n))

    def test_nothing_before_64_values(self):
        b = SixSigmaBaseline()
        assert feed(b, self.noisy(63) + [100.0]) == [False] * 64
        assert b.update(ev(64, 100.0)) is True  # 64 values are in now

    def test_six_standard_deviations_of_the_previous_values(self):
        base = self.noisy(128)
        mean, sd = np.mean(base), np.std(base)
        b = SixSigmaBaseline()
        feed(b, base)
        assert b.update(ev(128, mean + 6.2 * sd)) is True
        b = SixSigmaBaseline()
        feed(b, base)
        assert b.update(ev(128, mean + 5.8 * sd)) is False
        assert b.update(ev(129, mean - 50 * sd)) is False  # only upward

    def test_window_is_128_values_and_flagged_values_enter_it(self):
        b = SixSigmaBaseline()
        feed(b, [10.0] * 10 + self.noisy(128))
        assert len(b.loss_history) == 128 and max(b.loss_history) < 3
        assert b.update(ev(138, 3.0)) is True
        assert b.loss_history[-1] == 3.0

    def test_gradient_norm_alone_triggers(self):
        b = SixSigmaBaseline()
        feed(b, self.noisy(100), self.noisy(100, seed=1))
        assert b.update(ev(100, 2.0, 50.0)) is True
        assert b.update(ev(101, 2.0, None)) is False  # no grad norm: the loss alone decides

    def test_non_finite_values_are_flagged_and_kept_out(self):
        b = SixSigmaBaseline()
        feed(b, self.noisy(100), self.noisy(100, seed=1))
        assert b.update(ev(100, math.nan, 2.0)) is True
        assert b.update(ev(101, 2.0, math.inf)) is True
        assert all(math.isfinite(v) for v in (*b.loss_history, *b.grad_history))
        assert b.update(ev(102, 2.0, 2.0)) is False


def test_flag_run_gives_one_mark_per_step():
    events = [ev(i, 1.0) for i in range(30)] + [ev(30, math.nan)]
    marks = flag_run(NaiveBaseline(), events)
    assert (
        len(marks) == 31
        and marks[-1] == Mark(30, True)
        and not any(m.is_anomaly for m in marks[:-1])
    )
