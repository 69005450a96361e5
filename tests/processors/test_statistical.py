"""The statistical detector on hand-made runs (fixed seeds, no shared data)."""

from __future__ import annotations

import doctest
import json
import math
import random
import statistics

import numpy as np
import pytest
from pydantic import ValidationError

from spikeguard.processors import robust_stats
from spikeguard.processors import outlier_model
from spikeguard.processors.detectors import level, statistical
from spikeguard.processors.detectors.statistical import (
    SeriesConfig,
    StatisticalConfig,
    StatisticalDetector,
)
from spikeguard.processors.decision_table import BASE_URGENCY, urgency
from spikeguard.processors.robust_stats import RollingMedian
from spikeguard.schemas import AnomalyType, StepEvent, Urgency


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


def incidents(verdicts) -> list[int]:
    """Flagged steps that call for more than the guard's skip of one update."""
    return [v.step for v in verdicts if v.is_anomaly and v.type != AnomalyType.OUTLIER_STEP]


def acted_on(verdicts) -> list[int]:
    """Incidents the policy answers with more than an alert: not a level shift in proportion
    to the run's own level moves (a LOW slow rise, rule loss_level_shift)."""
    return [s for s in incidents(verdicts) if "loss_level_shift" not in verdicts[s].rules]


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
    assert doctest.testmod(outlier_model).failed == 0
    assert doctest.testmod(level).failed == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_run_is_quiet(seed: int) -> None:
    verdicts = judge(healthy(5000, seed))
    assert flagged(verdicts) == []
    assert all(v.detector == "statistical" and v.run_id == "r" for v in verdicts)


@pytest.mark.heavy
def test_heavy_tailed_noise_is_quiet() -> None:
    rng = random.Random(3)
    pairs = []
    for _ in range(5000):
        # Student-t with 3 degrees of freedom, clipped like real logs (no 50-sigma noise).
        tdraw = rng.gauss(0, 1) / math.sqrt(rng.gammavariate(1.5, 1 / 1.5))
        pairs.append((math.exp(1.0 + 0.03 * max(-6.0, min(8.0, tdraw))), 0.5))
    verdicts = judge(pairs)
    # Student-t tails are heavier than the exponential tail the threshold assumes: a few
    # one-step outliers (the Guard's skips), never an incident.
    assert incidents(verdicts) == [] and len(flagged(verdicts)) <= 0.001 * len(pairs)


@pytest.mark.parametrize(
    "factors, expect_delay",
    [
        # an elevated point is an outlier step; the second in a row an incident
        ([6.0] * 3, 1),
        ([1.5, 1.5, 1.45, 1.45, 1.4, 1.4, 1.3], 1),
        ([1.8, 1.7, 1.7, 1.6, 1.6, 1.5], 1),
    ],
)
def test_sudden_spike_is_caught(factors, expect_delay) -> None:
    pairs = scaled(healthy(1500, 4, sigma=0.02), 1000, factors)
    assert flagged(judge(pairs))[0] == 1000  # at its first step (an outlier step until it lasts)
    hits = incidents(judge(pairs))
    assert hits, "missed"
    assert 1000 <= hits[0] <= 1000 + expect_delay
    v = judge(pairs)[hits[0]]
    assert (
        v.type == AnomalyType.LOSS_SPIKE
        and v.rules == ["loss_spike"]
        and 0.6 <= v.confidence <= 1.0
    )
    assert max(hits) < 1000 + len(factors) + 3  # and it ends when the loss is back


def test_jump_that_heals_at_once_is_an_outlier_step_not_an_incident() -> None:
    # x1.35 = ~15 noise units, one step, like the batch-induced jumps of real runs:
    # reported as its own low-urgency type (the guard skips that update), never a spike.
    pairs = scaled(healthy(1500, 5, sigma=0.02), 1000, [1.35])
    verdicts = judge(pairs)
    assert incidents(verdicts) == [] and flagged(verdicts) == [1000]
    v = verdicts[1000]
    assert v.type == AnomalyType.OUTLIER_STEP and v.rules == ["loss_outlier_step"]
    assert v.signals["z"] > 1 and 0.6 <= v.confidence <= 1.0 and not v.critical
    assert urgency(v.type, v.confidence, v.critical, 0.7) == Urgency.LOW
    # inside the run's own noise: nothing
    small = judge(scaled(healthy(1500, 5, sigma=0.02), 1000, [1.04]))
    assert flagged(small) == []


def _hard_batches(n: int, seed: int) -> list[tuple[float, None]]:
    """A healthy classification loss near zero with a hard batch now and then (2 %): each hard
    batch is x100-x4000 the usual loss, and the next batch is back."""
    rng = random.Random(seed)
    return [
        (
            rng.uniform(0.05, 0.9) if rng.random() < 0.02 else 2e-4 * math.exp(rng.gauss(0, 1.0)),
            None,
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_point_is_a_divergence_only_far_beyond_the_runs_own_noise(seed) -> None:
    """x10 above the level is a divergence where the run's noise is light, not where its own
    hard batches reach x1000: there one point must also be twice its threshold above the level."""
    verdicts = judge(_hard_batches(3000, seed))
    assert [v.step for v in verdicts if v.type == AnomalyType.DIVERGENCE] == []
    light = judge(scaled(healthy(1500, seed), 1000, [12.0]))
    assert light[1000].type == AnomalyType.DIVERGENCE


def test_one_point_whose_update_the_trainer_skipped_is_a_spike_not_yet_a_divergence() -> None:
    """The weights never took that update: whether the loss stays up is for the next points (a
    mixture density network's hard batch, x12 once while its loss was still positive, had its
    LR cut). Held up, it is still an incident; not skipped, one point is a divergence."""
    evs = events(scaled(healthy(1500, 3), 1000, [12.0]))
    evs[1000] = evs[1000].model_copy(update={"update_skipped": True, "skip_reason": "outlier_step"})
    verdicts = StatisticalDetector().update_many(evs)
    assert verdicts[1000].type == AnomalyType.LOSS_SPIKE
    assert not any(v.is_anomaly for v in verdicts[1001:])
    held = events(scaled(healthy(1500, 3), 1000, [12.0] * 3))
    held[1000] = held[1000].model_copy(
        update={"update_skipped": True, "skip_reason": "outlier_step"}
    )
    assert [v.is_anomaly for v in StatisticalDetector().update_many(held)[1000:1003]] == [True] * 3


def test_a_drop_is_not_an_anomaly() -> None:
    pairs = scaled(healthy(1500, 6), 1000, [0.3] * 3 + [0.5] * 497)
    assert flagged(judge(pairs)) == []


def test_flagged_points_do_not_teach_the_baseline() -> None:
    pairs = scaled(healthy(1600, 7), 1000, [3.0] * 100)  # a long plateau of bad steps
    verdicts = judge(pairs)
    # flagged while it lasts; a plateau that stays flat is a spike still there (the policy
    # rolls it back), not a divergence, which keeps rising (issue 36: a step is no divergence)
    assert set(range(1000, 1100)) <= set(flagged(verdicts))
    assert {verdicts[t].type for t in range(1000, 1100)} == {AnomalyType.LOSS_SPIKE}
    # (the rise test may still report the block that holds the end of the plateau)
    assert not any(v.is_anomaly for v in verdicts[1200:])


def test_nan_is_reported_and_does_not_poison_the_statistics() -> None:
    det = StatisticalDetector()
    evs = events(healthy(1200, 8))
    det.update_many(evs[:1000])
    before = json.dumps(det.state_dict())
    for value in (math.nan, math.inf, -math.inf):
        v = det.update(evs[1000].model_copy(update={"loss": value}))
        assert (
            v.is_anomaly and v.critical and v.type == AnomalyType.NON_FINITE and v.confidence == 1.0
        )
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
    assert verdicts[hits[0]].type in (
        AnomalyType.DIVERGENCE,
        AnomalyType.LOSS_SPIKE,
        AnomalyType.SLOW_RISE,
        AnomalyType.OUTLIER_STEP,
    )


@pytest.mark.heavy  # ~1 s a seed
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_slow_rise_in_a_short_run_is_judged_against_the_differences_from_before_it(seed) -> None:
    # x3 over the last 1,500 of 4,000 steps of a falling curve (a run of 80 blocks): the rise
    # test's differences used to join their tails at once while a tail held under 100 of them,
    # so the rise taught its own bar (~6x as fast as it rose) and was never judged.
    start, span = 2500, 1500
    pairs = [
        (loss * math.exp(math.log(3.0) * (max(0, t - start) / span) ** 1.5), g)
        for t, (loss, g) in enumerate(healthy(4000, seed))
    ]
    verdicts = judge(pairs)
    rises = [v.step for v in verdicts if v.type == AnomalyType.SLOW_RISE]
    assert rises and start < rises[0] < start + 1000  # before x1.8
    assert incidents(verdicts)[0] > start


@pytest.mark.parametrize("period", [2, 7, 20])
def test_growing_oscillation_is_caught(period: int) -> None:
    pairs = healthy(2600, 10)
    out = []
    for t, (loss, g) in enumerate(pairs):
        if t >= 2000:
            amp = min(0.6, 0.01 * math.exp((t - 2000) / 60))
            loss *= math.exp(
                amp
                * (1 if period == 2 and t % 2 else -1 if period == 2 else 1)
                * (1 if period == 2 else math.sin(2 * math.pi * t / period))
            )
        out.append((loss, g))
    hits = flagged(judge(out))
    assert hits and min(hits) > 2000 and hits[0] < 2400


@pytest.mark.heavy
def test_gradient_norm_spike_is_a_gradient_explosion() -> None:
    pairs = scaled(healthy(1500, 11), 1000, [1.0] * 4, grad_factors=[50.0, 80.0, 60.0, 40.0])
    verdicts = judge(pairs)
    # flagged once it lasts (its first step alone is what healthy real runs also show)
    assert flagged(verdicts)[0] == 1001
    assert verdicts[1001].type == AnomalyType.GRADIENT_EXPLOSION
    assert verdicts[1001].rules == ["grad_norm_spike"]
    # one step with the loss calm (real runs: x16-x134) is said, not flagged; lasting, it is
    one = judge(scaled(healthy(1500, 11), 1000, [1.0], grad_factors=[80.0]))
    assert flagged(one) == [] and one[1000].signals["grad_norm_jump"] == 1
    two = judge(scaled(healthy(1500, 11), 1000, [1.0] * 2, grad_factors=[80.0, 60.0]))
    assert flagged(two)[0] == 1001 and two[1001].type == AnomalyType.GRADIENT_EXPLOSION
    healing = judge(scaled(healthy(1500, 11), 1000, [1.0] * 2, grad_factors=[74.0, 3.0]))
    assert flagged(healing) == []  # x74 then x3 (a real ResNet step): it healed, it did not last
    lone = judge(
        scaled(healthy(1500, 11), 1000, [1.0], grad_factors=[80.0]),
        StatisticalConfig(grad_persist_steps=1),
    )
    assert lone[1000].type == AnomalyType.GRADIENT_EXPLOSION  # the old rule, still a setting
    # a single x7 grad blip (real runs have them) is not
    assert flagged(judge(scaled(healthy(1500, 11), 1000, [1.0], grad_factors=[7.0]))) == []


def test_a_grad_norm_jump_with_the_loss_reacting_is_flagged_at_once() -> None:
    pairs = scaled(healthy(1500, 11), 1000, [1.4], grad_factors=[50.0])
    verdicts = judge(pairs)
    assert flagged(verdicts) == [1000]  # the loss's own level test speaks for the step
    assert verdicts[1000].type == AnomalyType.OUTLIER_STEP and verdicts[1000].rules == [
        "loss_outlier_step"
    ]


def plateau(n: int, seed: int, sigma: float = 0.01) -> list[tuple[float, None]]:
    """A flat loss (the end of a schedule), Gaussian noise in log space, no grad norm."""
    rng = random.Random(seed)
    return [(math.exp(1.0 + rng.gauss(0, sigma)), None) for _ in range(n)]


@pytest.mark.heavy
def test_a_rise_is_caught_against_the_runs_own_history_and_healthy_shapes_are_not() -> None:
    # +30 % over 1000 steps after 3000 flat ones: the rise test's block medians see it.
    pairs = [
        (loss * math.exp(math.log(1.3) * min(1000, max(0, t - 3000)) / 1000), g)
        for t, (loss, g) in enumerate(plateau(5000, 21))
    ]
    verdicts = judge(pairs)
    # (its first block over the bar is an alert, a LOW level shift: the rise must go on rising
    # since that block before it cuts the LR, as a step of the data's level never does)
    rises = [v.step for v in verdicts if v.rules == ["loss_slow_rise"]]
    assert rises and 3000 < rises[0] < 3600  # before the run has risen +18 %
    assert incidents(verdicts)[0] >= 3000
    v = verdicts[rises[0]]
    assert (
        v.rules == ["loss_slow_rise"] and BASE_URGENCY[v.type] == Urgency.MEDIUM and not v.critical
    )
    assert not any(
        v.is_anomaly for v in judge(pairs, StatisticalConfig(watch_level=False))[: rises[0] + 1]
    )
    # The old slow-rise test (a CUSUM above the best level ever reached) called these rises.
    rng = np.random.default_rng(22)
    t = np.arange(20000)
    healthy_shapes = {
        "plateau": np.exp(1 + 0.01 * rng.normal(size=t.size)),
        "drift +3 %": np.exp(1 + 0.01 * rng.normal(size=t.size)) * (1 + 0.03 * t / t.size),
        "stationary batch-4 MSE": rng.chisquare(4, t.size) / 4,
        "stationary batch-1 MSE": rng.chisquare(1, t.size),
        "falling": (1 + 3 * np.exp(-t / 3000)) * np.exp(0.05 * rng.normal(size=t.size)),
        "benign permanent drop": np.exp(1 + 0.01 * rng.normal(size=t.size))
        * np.where(t > 8000, 0.7, 1.0),
    }
    for name, losses in healthy_shapes.items():
        assert incidents(judge([(float(x), None) for x in losses])) == [], name


@pytest.mark.heavy
def test_a_warm_restart_is_explained_by_the_learning_rate_it_carries() -> None:
    rng = np.random.default_rng(23)
    t = np.arange(12000)
    phase = t % 4000
    lr = 0.1 * 0.5 * (1 + np.cos(np.pi * phase / 4000)) + 1e-4  # cosine with warm restarts
    loss = (1 + 2 * np.exp(-t / 5000)) * (1 + 0.4 * np.exp(-phase / 300) * (t >= 4000))
    loss *= np.exp(0.03 * rng.normal(size=t.size))
    evs = [
        StepEvent(run_id="r", step=i, time=0.0, loss=float(x), lr=float(r))
        for i, (x, r) in enumerate(zip(loss, lr))
    ]
    assert incidents(StatisticalDetector().update_many(evs)) == []
    blind = [e.model_copy(update={"lr": None}) for e in evs]
    assert incidents(StatisticalDetector().update_many(blind))  # without the LR it is a rise


def test_a_spike_early_in_the_run_is_caught_by_the_level_test() -> None:
    # Inside the streaming monitor's warm-up (like the real DLRM run's spikes at
    # points 22 and 34: x3.9 and x2.6); before the tail has settled the bar is x1.5.
    pairs = scaled(plateau(80, 23, sigma=0.02), 24, [1.6, 1.6, 1.5])
    verdicts = judge(pairs)
    assert [(v.step, v.type) for v in verdicts if v.is_anomaly][:2] == [
        (24, AnomalyType.OUTLIER_STEP),
        (25, AnomalyType.LOSS_SPIKE),
    ]
    assert flagged(judge(pairs, StatisticalConfig(watch_level=False))) == []
    assert flagged(judge(scaled(plateau(80, 23, sigma=0.02), 24, [1.3, 1.3, 1.2]))) == []


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


@pytest.mark.heavy
def test_state_is_bounded() -> None:
    # Every window is full once the rise test's tails are (rise_history blocks of rise_block).
    det = StatisticalDetector()
    cfg = det.config.level
    longest = max(cfg.rise_horizons)
    history = max(cfg.rise_history, 2 * (cfg.rise_min_blocks + longest))
    full = max(cfg.rise_block * (history + longest), 2 * cfg.climb_history)
    det.update_many(events(healthy(full + 1000, 15)))
    small = len(json.dumps(det.state_dict()))
    det.update_many(events(healthy(10000, 16), start=full + 1000))
    assert len(json.dumps(det.state_dict())) <= small * 1.01  # (the floats' digits vary)


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


def test_a_fall_that_slows_while_the_noise_grows_makes_no_outliers() -> None:
    # A long LR warm-up: the loss falls fast, then slows, while its log-space noise grows.
    # A median of the last 100 points sits 50 steps behind the fall: the tail would learn
    # residuals shifted down by it, and ordinary noise would be elevated once the fall slows.
    rng = random.Random(33)
    model = outlier_model.loss_config().model()
    elevated = []
    for t in range(1500):
        sigma = 0.01 * math.exp(math.log(20.0) * min(t, 500) / 500)
        y = math.log(0.7 + 1.6 * math.exp(-t / 120)) + rng.gauss(0.0, sigma)
        judged = model.judge(y)
        if judged.elevated:
            elevated.append(t)
        model.advance(y, judged)
    assert elevated == []  # the window's median alone: 364, 397 and 503
    # A spike on the level part is still an outlier.
    assert model.judge(math.log(0.7) + math.log(4.0)).elevated


def growing_noise(seed: int) -> list[tuple[float, None]]:
    """A healthy shape: the loss falls to a plateau while its log-space noise grows x15 over
    600 steps (a long LR warm-up), 3,000 steps."""
    rng = random.Random(seed)
    pairs = []
    for t in range(3000):
        sigma = 0.02 * math.exp(math.log(15.0) * min(max(t - 200, 0), 600) / 600)
        trend = math.log(0.7 + 1.6 * math.exp(-t / 150))
        pairs.append((math.exp(trend + rng.gauss(0.0, sigma)), None))
    return pairs


def test_noise_that_grows_without_raising_the_loss_is_not_an_oscillation() -> None:
    # A long LR warm-up: the loss falls to a plateau while its step-to-step swings grow
    # x15 (in log space) over 600 steps. Swings that leave the loss where it was are noise.
    pairs = growing_noise(32)
    verdicts = judge(pairs)
    assert [v.step for v in verdicts if v.type == AnomalyType.OSCILLATION] == []
    # The swings are there: judged without the level (whether the loss moved), they are one.
    blind = judge(pairs, StatisticalConfig(watch_level=False))
    assert [v.step for v in blind if v.type == AnomalyType.OSCILLATION]


def climb(n: int, seed: int, start: int, peak: float, rise: int, power: float, sigma: float = 0.02):
    """A healthy run that starts to climb at ``start`` (log excess ``peak * (t / rise) ** power``),
    and the step at which the climb is three noise sigmas up (where the simulator's label starts)."""
    pairs = healthy(n, seed, sigma=sigma)
    out, labelled = [], None
    for t, (loss, g) in enumerate(pairs):
        excess = peak * (max(0, t - start) / rise) ** power
        if labelled is None and excess > 3 * sigma:
            labelled = t
        out.append((loss * math.exp(excess), g))
    return out, labelled


@pytest.mark.heavy  # 40 runs of the simulator: ~4 s, over the unit tier's 3 s budget
def test_gradual_divergences_are_caught_within_200_steps_of_rising_3_sigma() -> None:
    # Slow climbs (the simulator's divergence shapes) stay under the one-point outlier bar
    # for tens of steps while the level follows them; the climb test measures them from the
    # level before them, against its own statistic's past (issue 36: the count it replaced,
    # "8 of 10 over q90", assumed independent points, and found these within 15 steps but
    # fired hundreds of times per 10k steps on healthy loss whose difficulty wanders).
    # A climb cuts the LR only once it has gone on rising since it began (a step of the data's
    # level jumps and stays flat): delays median 87 / max 191 before that, 136 / 234 with it,
    # 152 / 234 once a block rise must go on past its first two blocks (the first may mix levels).
    delays = []
    for seed, rise, power, sigma in [
        (40, 300, 1.0, 0.02),
        (41, 400, 2.0, 0.02),
        (42, 600, 1.5, 0.02),
        (43, 200, 1.0, 0.05),
        (44, 600, 2.5, 0.02),
        (45, 100, 1.0, 0.02),
        (46, 300, 1.0, 0.05),
        (47, 400, 2.0, 0.05),
    ]:
        pairs, labelled = climb(3000, seed, 2000, math.log(2.0), rise, power, sigma)
        verdicts = judge(pairs)
        hits = acted_on(verdicts)  # (a level-shift alert may come first: proportion)
        assert (
            hits
            and hits[0] > 2000
            and verdicts[hits[0]].type
            in (AnomalyType.DIVERGENCE, AnomalyType.SLOW_RISE, AnomalyType.LOSS_SPIKE)
        ), (seed, hits[:3])
        delays.append(max(0, hits[0] - labelled))
    assert statistics.median(delays) <= 160 and max(delays) <= 250, delays
    # A divergence, said by the climb test.
    pairs, _ = climb(3000, 41, 2000, math.log(2.0), 400, 2.0)
    verdicts = judge(pairs)
    assert verdicts[acted_on(verdicts)[0]].rules == ["loss_climb"]


@pytest.mark.parametrize("seed", range(40, 50))
def test_noise_that_grows_makes_no_climb(seed) -> None:
    # Noise growing x15 over 600 steps: the tail's quantiles lag it, so many points are
    # over its 90th percentile, but as many fall below the level (a climb has none there).
    pairs = growing_noise(seed)
    assert [v.step for v in judge(pairs) if "loss_climb" in v.rules] == []


def flip_flop(
    seed: int, ramp: int, offset: float, amp: float = 0.4, start: int = 2000, sigma: float = 0.02
):
    """A healthy run whose loss flip-flops from ``start`` with a swing growing to ``amp`` over
    ``ramp`` steps around a mean lifted by ``offset`` of it (the simulator's period-2
    oscillation), and the step at which the swing is three noise sigmas."""
    out, labelled = [], None
    for t, (loss, g) in enumerate(healthy(start + 600, seed, sigma=sigma)):
        k = t - start
        env = amp * min(1.0, k / ramp) if k >= 0 else 0.0
        if labelled is None and env > 3 * sigma:
            labelled = t
        out.append((loss * math.exp(env * (offset + (1 - offset) * (1 if k % 2 else -1))), g))
    return out, labelled


def test_a_flip_flop_that_lifts_the_loss_is_an_oscillation_within_about_15_steps() -> None:
    # The simulator's period-2 oscillation with its mean lifted 40-50 % of its swing. The
    # swing test alone needs x4 its usual swing size (24-45 steps, median 38); an alternating
    # swing is an oscillation at x2.5.
    delays = []
    for seed, ramp, offset in [
        (60, 100, 0.4),
        (61, 60, 0.5),
        (62, 80, 0.45),
        (63, 100, 0.5),
        (64, 60, 0.4),
    ]:
        pairs, labelled = flip_flop(seed, ramp, offset)
        verdicts = judge(pairs)
        hits = incidents(verdicts)
        assert hits and hits[0] > 2000 and verdicts[hits[0]].type == AnomalyType.OSCILLATION
        delays.append(hits[0] - labelled)
    assert statistics.median(delays) <= 15, delays


def test_a_flip_flop_whose_mean_does_not_move_is_an_oscillation() -> None:
    # A flip-flop around the level (offset 0-0.2 of its swing) never opens the raise gate,
    # so the swing test alone leaves it (and healthy noise that grows) alone; it alternates.
    for seed, ramp, offset in [(70, 60, 0.0), (71, 100, 0.1), (72, 80, 0.2)]:
        pairs, labelled = flip_flop(seed, ramp, offset)
        verdicts = judge(pairs)
        hits = incidents(verdicts)
        assert hits and labelled <= hits[0] <= labelled + 20, (seed, labelled, hits[:3])
        assert verdicts[hits[0]].type == AnomalyType.OSCILLATION
        assert verdicts[hits[0]].rules == ["loss_alternation"]


def two_batch_losses(seed: int, steps: int = 2500, lr: float = 0.02) -> list[float]:
    """A healthy torch regression that cycles through two fixed batches of 8: its loss
    alternates batch to batch, and in log space the gap between the two batches grows
    as both fall to their floors."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 10, generator=generator)
    y = x @ torch.randn(10, 1, generator=generator) + 0.1 * torch.randn(16, 1, generator=generator)
    torch.manual_seed(seed)
    model = torch.nn.Linear(10, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for t in range(steps):
        batch = slice(8 * (t % 2), 8 * (t % 2) + 8)
        loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.heavy
def test_a_healthy_run_cycling_through_two_batches_is_not_an_oscillation() -> None:
    # Its swings grow past x2.5 and alternate (the lower batch falls to its floor, the
    # higher one stays), but its highs do not rise: no LR cut for a run that is fine.
    detector = StatisticalDetector()
    config = detector.config.loss
    alternating, oscillations = 0, []
    for step, loss in enumerate(two_batch_losses(1)):
        verdict = detector.update(StepEvent(run_id="r", step=step, time=0.0, loss=loss))
        swings = detector.state.judgement.loss_swings
        alternating += (
            swings[3] >= config.alt_level and detector.state.loss.alternation() >= config.alt_ratio
        )
        if verdict.type == AnomalyType.OSCILLATION:
            oscillations.append(step)
    assert alternating > 100 and oscillations == []


def alternation(values: list[float]) -> list[float]:
    """The loss swing test's alternation (one-step over two-step swing size) after each value."""
    monitor = SeriesConfig().monitor()
    out = []
    for y in values:
        judged = monitor.judge(y)
        monitor.advance(judged)
        monitor.learn(y)
        out.append(monitor.alternation())
    return out


def test_independent_noise_does_not_alternate_whatever_its_distribution() -> None:
    # One-step and two-step swings of independent noise are each the difference of two
    # independent draws: equal in expectation, heavy tails or growing spread alike.
    rng = np.random.default_rng(3)
    n = 4000
    growing = 0.02 * np.exp(np.log(15.0) * np.clip(np.arange(n) - 500, 0, 600) / 600)
    shapes = {
        "gaussian": rng.normal(0.0, 0.02, n),
        "student-t 2": 0.02 * rng.standard_t(2, n),
        "log chi-square 1 (batch-1 MSE)": np.log(rng.chisquare(1, n)),
        "growing x15": rng.normal(0.0, 1.0, n) * growing,
        "falling": -np.log1p(np.arange(n) / 50) + rng.normal(0.0, 0.02, n),
    }
    for name, values in shapes.items():
        ratios = alternation(list(values))[100:]
        assert max(ratios) < 0.8 * SeriesConfig().alt_ratio, (name, max(ratios))
    # A flip-flop in the same noise alternates within a few steps of starting.
    flip = rng.normal(0.0, 0.02, 400) + 0.1 * np.where(np.arange(400) % 2, 1.0, -1.0) * (
        np.arange(400) >= 300
    )
    ratios = alternation(list(flip))
    assert max(ratios[:300]) < 2.0 and ratios[310] > SeriesConfig().alt_ratio


@pytest.mark.heavy
def test_noise_that_grows_fast_makes_no_oscillation_at_any_of_30_seeds() -> None:
    # The growing-noise shape has swings over x2.5 their usual size for ~1,300 of its 3,000
    # steps: a runs test on the signs (16 points all alternating about their median, 1.6e-4
    # each for independent points) made an oscillation at 2 of these seeds; the alternation
    # ratio reached 2.15 at most, under its bar of 3.
    found = {
        seed: [v.step for v in judge(growing_noise(seed)) if v.type == AnomalyType.OSCILLATION]
        for seed in range(30, 60)
    }
    assert {seed: steps for seed, steps in found.items() if steps} == {}


@pytest.mark.parametrize("seed", [38, 44, 47, 48, 51])
def test_noise_that_grows_fast_is_not_an_oscillation_at_any_seed(seed) -> None:
    # The growing-noise shape above at the seeds where swings x3 (or x3.5) their usual size
    # with the loss raised by chance made an oscillation, which the policy answers with an
    # LR cut; at x4 none of seeds 30-59 does.
    pairs = growing_noise(seed)
    assert [v.step for v in judge(pairs) if v.type == AnomalyType.OSCILLATION] == []
