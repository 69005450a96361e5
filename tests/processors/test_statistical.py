"""The statistical detector on hand-made runs (fixed seeds, no shared data)."""

from __future__ import annotations

import doctest
import json
import math
import random

import pytest
from pydantic import ValidationError

from spikeguard.processors import robust_stats
from spikeguard.processors.detectors import statistical
from spikeguard.processors.detectors.statistical import SeriesConfig, StatisticalConfig, StatisticalDetector
from spikeguard.processors.robust_stats import RollingMedian
from spikeguard.schemas import AnomalyType, StepEvent


def healthy(n: int, seed: int = 0, sigma: float = 0.02, grad: bool = True) -> list[float | tuple]:
    """Log-space power-law decay with Gaussian noise: (loss, grad_norm) per step."""
    rng = random.Random(seed)
    out = []
    for t in range(n):
        trend = math.log(2.5 + 8.0 * (1 + t / 50) ** -0.7)
        loss = math.exp(trend + rng.gauss(0, sigma))
        g = math.exp(math.log(0.5) + rng.gauss(0, 0.08)) if grad else None
        out.append((loss, g))
    return out


def events(pairs, run_id: str = "r", start: int = 0, epoch: int = 0) -> list[StepEvent]:
    return [
        StepEvent(run_id=run_id, step=start + i, epoch=epoch, time=0.0, loss=loss, grad_norm=g)
        for i, (loss, g) in enumerate(pairs)
    ]


def judge(pairs, config: StatisticalConfig | None = None):
    return StatisticalDetector(config).update_many(events(pairs))


def flagged(verdicts) -> list[int]:
    return [v.step for v in verdicts if v.is_anomaly]


def scaled(pairs, at: int, factors: list[float], grad_factors: list[float] | None = None):
    out = list(pairs)
    for k, f in enumerate(factors):
        loss, g = out[at + k]
        gf = grad_factors[k] if grad_factors else 1.0
        out[at + k] = (loss * f, None if g is None else g * gf)
    return out


def test_doctests() -> None:
    assert doctest.testmod(robust_stats).failed == 0
    assert doctest.testmod(statistical).failed == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_run_is_quiet(seed: int) -> None:
    verdicts = judge(healthy(5000, seed))
    assert flagged(verdicts) == []
    assert all(v.detector == "statistical" and v.run_id == "r" for v in verdicts)


def test_heavy_tailed_noise_is_quiet() -> None:
    rng = random.Random(3)
    pairs = []
    for t in range(5000):
        # Student-t with 3 degrees of freedom, clipped like real logs (no 50-sigma noise).
        tdraw = rng.gauss(0, 1) / math.sqrt(rng.gammavariate(1.5, 1 / 1.5))
        pairs.append((math.exp(1.0 + 0.03 * max(-6.0, min(8.0, tdraw))), 0.5))
    assert flagged(judge(pairs)) == []


@pytest.mark.parametrize(
    "factors, expect_delay",
    [
        ([6.0] * 3, 0),  # huge: flagged at its first step
        ([1.5, 1.5, 1.45, 1.45, 1.4, 1.4, 1.3], 2),  # ~20 noise units, persistent: confirmed
        ([1.8, 1.7, 1.7, 1.6, 1.6, 1.5], 0),  # ~30 noise units: at once
    ],
)
def test_sudden_spike_is_caught(factors, expect_delay) -> None:
    pairs = scaled(healthy(1500, 4, sigma=0.02), 1000, factors)
    hits = flagged(judge(pairs))
    assert hits, "missed"
    assert 1000 <= hits[0] <= 1000 + expect_delay
    v = judge(pairs)[hits[0]]
    assert v.type == AnomalyType.LOSS_SPIKE and v.rules == ["loss_spike"] and 0.6 <= v.confidence <= 1.0
    assert max(hits) < 1000 + len(factors) + 3  # and it ends when the loss is back


def test_jump_that_heals_at_once_is_not_an_anomaly() -> None:
    # x1.35 = ~15 noise units, one step, like the batch-induced jumps of real runs
    pairs = scaled(healthy(1500, 5, sigma=0.02), 1000, [1.35])
    verdicts = judge(pairs)
    assert flagged(verdicts) == []
    assert verdicts[1000].signals["z"] > 6 and verdicts[1000].confidence < 0.5  # suspicious, said


def test_a_drop_is_not_an_anomaly() -> None:
    pairs = scaled(healthy(1500, 6), 1000, [0.3] * 3 + [0.5] * 497)
    assert flagged(judge(pairs)) == []


def test_flagged_points_do_not_teach_the_baseline() -> None:
    pairs = scaled(healthy(1600, 7), 1000, [3.0] * 100)  # a long plateau of bad steps
    verdicts = judge(pairs)
    assert set(range(1000, 1100)) <= set(flagged(verdicts))  # flagged all along, never learned
    assert not any(v.is_anomaly for v in verdicts[1110:])


def test_nan_is_reported_and_does_not_poison_the_statistics() -> None:
    det = StatisticalDetector()
    evs = events(healthy(1200, 8))
    det.update_many(evs[:1000])
    before = json.dumps(det.state_dict())
    for value in (math.nan, math.inf, -math.inf):
        v = det.update(evs[1000].model_copy(update={"loss": value}))
        assert v.is_anomaly and v.critical and v.type == AnomalyType.NON_FINITE and v.confidence == 1.0
    v = det.update(evs[1000].model_copy(update={"grad_norm": math.nan}))
    assert v.is_anomaly and v.rules == ["grad_norm_non_finite"]
    assert json.dumps(det.state_dict()) == before
    assert flagged(det.update_many(evs[1000:])) == []


def test_slow_divergence_is_caught() -> None:
    pairs = healthy(3000, 9)
    pairs = [(loss * math.exp(0.002 * max(0, t - 2000)), g) for t, (loss, g) in enumerate(pairs)]
    verdicts = judge(pairs)
    hits = flagged(verdicts)
    assert hits and 2000 < hits[0] < 2200 and min(hits) >= 2000
    assert verdicts[hits[0]].type in (AnomalyType.DIVERGENCE, AnomalyType.LOSS_SPIKE)


@pytest.mark.parametrize("period", [2, 7, 20])
def test_growing_oscillation_is_caught(period: int) -> None:
    pairs = healthy(2600, 10)
    out = []
    for t, (loss, g) in enumerate(pairs):
        if t >= 2000:
            amp = min(0.6, 0.01 * math.exp((t - 2000) / 60))
            loss *= math.exp(amp * (1 if period == 2 and t % 2 else -1 if period == 2 else 1)
                             * (1 if period == 2 else math.sin(2 * math.pi * t / period)))
        out.append((loss, g))
    hits = flagged(judge(out))
    assert hits and min(hits) > 2000 and hits[0] < 2400


def test_gradient_norm_spike_is_a_gradient_explosion() -> None:
    pairs = scaled(healthy(1500, 11), 1000, [1.0] * 4, grad_factors=[50.0, 80.0, 60.0, 40.0])
    verdicts = judge(pairs)
    assert flagged(verdicts)[0] == 1000
    assert verdicts[1000].type == AnomalyType.GRADIENT_EXPLOSION
    # a single x7 grad blip (real runs have them) is not
    assert flagged(judge(scaled(healthy(1500, 11), 1000, [1.0], grad_factors=[7.0]))) == []


def test_runs_without_grad_norm_and_odd_losses() -> None:
    pairs = [(loss, None) for loss, _ in healthy(800, 12)]
    assert flagged(judge(pairs)) == []
    det = StatisticalDetector()
    for i, loss in enumerate([0.0, -1.0, 1e-30, 5.0]):  # clipped before the log, no crash
        det.update(StepEvent(run_id="r", step=i, time=0.0, loss=loss))


def test_epochs_and_repeated_steps() -> None:
    det = StatisticalDetector()
    evs = events(healthy(600, 13))
    det.update_many(evs[:500])
    rerun = events(healthy(600, 13)[400:500], start=400, epoch=1)  # after a rollback to step 400
    verdicts = det.update_many(rerun)
    assert all(v.epoch == 1 for v in verdicts) and flagged(verdicts) == []


def test_update_many_equals_update_and_state_round_trip() -> None:
    pairs = scaled(healthy(3000, 14), 2000, [4.0] * 5)
    evs = events(pairs)
    one = StatisticalDetector()
    a = [one.update(e) for e in evs]
    first = StatisticalDetector()
    b = first.update_many(evs[:1500])
    second = StatisticalDetector()
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    b += second.update_many(evs[1500:])
    assert a == b


def test_state_is_bounded() -> None:
    det = StatisticalDetector()
    det.update_many(events(healthy(2000, 15)))
    small = len(json.dumps(det.state_dict()))
    det.update_many(events(healthy(20000, 16), start=2000))
    assert len(json.dumps(det.state_dict())) <= small + 200


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValidationError, match="z_spike"):
        SeriesConfig(z_spike=-1)
    with pytest.raises(ValidationError, match="unknown_field"):
        StatisticalConfig(unknown_field=1)


def test_rolling_median() -> None:
    med = RollingMedian(4)
    assert math.isnan(med.get()) and math.isnan(med.max())
    for x in [5.0, 1.0, 3.0, 2.0, 10.0]:
        med.update(x)
    assert med.values() == [1.0, 3.0, 2.0, 10.0] and med.get() == 2.5 and med.max() == 10.0
    copy = RollingMedian(4)
    copy.load_state_dict(med.state_dict())
    assert copy.values() == med.values() and copy.get() == med.get()
