"""The published trainers' spike rules behave as their sources do."""

from __future__ import annotations

import math

import numpy as np

from spikeguard.lab.baselines import BASELINES
from spikeguard.lab.trainer_rules import (
    AxolotlRobustZ,
    KillLossSpike,
    LightningSpike,
    MetaseqEwm,
    robust_z,
)
from spikeguard.schemas import StepEvent


def ev(step: int, loss: float, grad: float | None = None) -> StepEvent:
    return StepEvent(run_id="t", step=step, loss=loss, grad_norm=grad, time=float(step))


def feed(rule, losses, grads=None, start: int = 0):
    grads = grads or [None] * len(losses)
    return [rule.update(ev(start + i, l, g)) for i, (l, g) in enumerate(zip(losses, grads))]


def noisy(n: int, seed: int = 0, level: float = 2.0, sd: float = 0.01) -> list[float]:
    return list(level + sd * np.random.default_rng(seed).standard_normal(n))


def test_every_rule_is_registered_as_a_baseline():
    assert {"axolotl", "metaseq", "lightning", "llm_foundry", "six_sigma", "naive"} <= set(
        BASELINES
    )


class TestLightning:
    def test_three_times_the_mean_of_the_last_ten_accepted_losses(self):
        rule = LightningSpike()
        feed(rule, [2.0] * 10)
        assert rule.update(ev(10, 6.0)) is True  # |6 - 2| >= 2 * 2
        assert list(rule.values) == [2.0] * 10  # the spike stayed out
        assert rule.update(ev(11, 5.9)) is False  # 2.95x
        assert list(rule.values) == [2.0] * 9 + [5.9]  # a normal loss went in, the oldest out

    def test_no_check_on_the_first_batch_and_an_improvement_is_never_a_spike(self):
        rule = LightningSpike()
        assert rule.update(ev(0, 100.0)) is False
        rule = LightningSpike()
        feed(rule, [1.0, 10.0])  # 10x the mean, but flagged: stays out
        assert rule.last == 1.0
        rule = LightningSpike(window=3)
        feed(rule, [1.0, 1.1, 1.2, 1.3, 1.4])
        assert rule.update(ev(5, 1.0)) is False  # below the last loss

    def test_non_finite_losses_are_spikes_and_kept_out(self):
        rule = LightningSpike()
        feed(rule, [2.0] * 5)
        assert rule.update(ev(5, math.nan)) and rule.update(ev(6, math.inf))
        assert all(math.isfinite(v) for v in rule.values)


class TestKillLossSpike:
    def test_nothing_until_the_window_of_one_hundred_is_full(self):
        rule = KillLossSpike()
        assert not any(feed(rule, [2.0] * 99 + [100.0] * 5))  # the first 100 fills it: 4 checked

    def test_the_fifth_consecutive_doubling_is_flagged_and_the_ones_after(self):
        rule = KillLossSpike()
        feed(rule, [2.0] * 100)
        flags = feed(rule, [4.5] * 7, start=100)
        assert flags == [False] * 4 + [True] * 3

    def test_a_normal_loss_resets_the_count(self):
        rule = KillLossSpike()
        feed(rule, [2.0] * 100)
        flags = feed(rule, [4.5] * 4 + [2.0] + [4.5] * 4, start=100)
        assert not any(flags) and rule.outliers == 4

    def test_high_losses_from_step_two_hundred(self):
        rule = KillLossSpike()
        flags = feed(rule, [12.0] * 199)
        assert not any(flags)
        assert rule.update(ev(199, 12.0)) is False  # step index 199 < 200
        assert rule.update(ev(200, 12.0)) is True  # half the window (all of it) above 10

    def test_a_nan_enters_the_window_and_blinds_the_mean(self):
        rule = KillLossSpike()
        feed(rule, [2.0] * 100)
        assert rule.update(ev(100, math.nan)) is False  # no finiteness check in the callback
        assert not any(feed(rule, [50.0] * 10, start=101))  # the mean is NaN: nothing is an outlier


class TestMetaseq:
    def test_ratio_to_the_ewm_before_this_loss(self):
        rule = MetaseqEwm()
        feed(rule, [2.0] * 20)
        assert rule.update(ev(20, 4.01)) is True
        assert rule.ewm == 2.0  # a skipped loss stays out of the mean
        assert rule.update(ev(21, 3.9)) is False
        assert rule.ewm == 0.8 * 2.0 + 0.2 * 3.9  # span 9: alpha 0.2

    def test_first_loss_starts_the_mean_and_non_finite_is_flagged(self):
        rule = MetaseqEwm()
        assert rule.update(ev(0, 10.0)) is False and rule.ewm == 10.0
        assert rule.update(ev(1, math.nan)) is True and rule.ewm == 10.0


class TestAxolotl:
    def test_robust_z_uses_median_and_scaled_mad(self):
        assert robust_z(4.0, [1.0, 2.0, 3.0]) == (4.0 - 2.0) / 1.4826
        assert robust_z(2.5, [2.0] * 5) == math.inf and robust_z(2.0, [2.0] * 5) == 0.0

    def test_outliers_stay_out_of_the_last_hundred_accepted_values(self):
        base = noisy(100)
        rule = AxolotlRobustZ()
        feed(rule, base)
        median = float(np.median(base))
        mad = float(np.median(np.abs(np.array(base) - median))) * 1.4826
        assert rule.update(ev(100, median + 6.5 * mad)) is True
        assert rule.update(ev(101, median + 5.5 * mad)) is False
        assert len(rule.loss_history) == 100 and max(rule.loss_history) < median + 6 * mad

    def test_nothing_before_one_hundred_values_and_grad_norm_alone_triggers(self):
        rule = AxolotlRobustZ()
        assert not any(feed(rule, noisy(99) + [100.0]))
        rule = AxolotlRobustZ()
        feed(rule, noisy(100), noisy(100, seed=1))
        assert rule.update(ev(100, 2.0, 50.0)) is True
        assert rule.update(ev(101, math.nan, 2.0)) is True
