"""Issue 36's two failure classes, as seeded property tests.

1. A healed spike never blinds the outlier model (and so the Guard's skip rule)
   to the next one: whatever spikes came before, a single point far above the
   run's healthy noise is elevated and its update skipped.
2. No test assumes independent residuals: healthy loss whose data difficulty
   wanders slowly (multiplicative AR(1) in log space) makes no climb and no rise.
"""

from __future__ import annotations

import math
import random

import pytest

from spikeguard.processors.detectors.statistical import StatisticalDetector
from spikeguard.processors.outlier_model import OutlierModel
from spikeguard.producers.skip_rule import SkipRule
from spikeguard.schemas import AnomalyType, StepEvent

#: what the climb and rise tests say (a climb is said as a divergence): an LR cut each
_SLOW = {AnomalyType.DIVERGENCE, AnomalyType.SLOW_RISE}
#: ... except the data's level moving in proportion to the run's own moves: an alert (LOW)
_ALERT_ONLY = "loss_level_shift"


def _acted_on(verdicts) -> list:
    """The slow judgements the policy answers with the LR (not the level-shift alerts)."""
    return [(v.step, v.rules) for v in verdicts if v.type in _SLOW and _ALERT_ONLY not in v.rules]


def _history_with_healed_spikes(rng: random.Random, n: int, noise: float) -> list[float]:
    """A healthy loss with 1 % step noise and healed spikes of any size (x1.5-x20, 1-8 points
    each) every few hundred steps."""
    out: list[float] = []
    next_spike = rng.randint(350, 500)
    while len(out) < n:
        if len(out) >= next_spike:
            size = math.exp(rng.uniform(math.log(1.5), math.log(20.0)))
            out += [2.0 * size * math.exp(rng.gauss(0, noise)) for _ in range(rng.randint(1, 8))]
            next_spike = len(out) + rng.randint(150, 400)
        else:
            out.append(2.0 * math.exp(rng.gauss(0, noise)))
    return out[:n]


@pytest.mark.parametrize("seed", range(6))
def test_a_point_far_above_the_healthy_noise_is_flagged_and_skipped_after_healed_spikes(
    seed,
) -> None:
    """Issue 36, class 1: the MoE runs' missed spikes were +38-44 % on ~1 % noise (40 sigma),
    each after a larger spike that had healed. Before, every point joined the tail capped at
    the bar: a spike of several points lifted the 99th percentile to the bar, and the bar
    ratcheted up (this test failed: such a point was not elevated)."""
    rng = random.Random(seed)
    noise = 0.01
    history = _history_with_healed_spikes(rng, 3000, noise)
    model, rule = OutlierModel(), SkipRule()
    for x in history:
        y = math.log(x)
        model.advance(y, model.judge(y))
        rule.decide(x)
    for _ in range(60):  # healthy steps after the last spike: the level is back
        x = 2.0 * math.exp(rng.gauss(0, noise))
        model.advance(math.log(x), model.judge(math.log(x)))
        rule.decide(x)
    k = 20.0  # robust sigmas of the healthy noise above the level
    spike = 2.0 * math.exp(k * noise)  # +22 %
    judged = model.judge(math.log(spike))
    assert judged.elevated, (judged.residual, judged.threshold)
    assert rule.decide(spike).skip


@pytest.mark.parametrize(
    ("phi", "spread", "noise", "student"),
    [
        (0.9, 0.01, 0.002, False),
        (0.99, 0.04, 0.002, False),  # wander 2.8x the step noise per step: runs of elevated points
        (0.999, 0.06, 0.002, True),
        (0.99, 0.02, 0.01, False),
        (0.995, 0.03, 0.005, True),
    ],
)
def test_slow_wander_of_the_data_difficulty_makes_no_climb_and_no_rise(
    phi, spread, noise, student
) -> None:
    """Issue 36, class 2: multiplicative AR(1) wander, stationary spread 1-6 %, on 0.2-1 % step
    noise. Before, the climb test ("8 of 10 over q90: 1e-7 for independent points") said
    divergence hundreds of times per 10k steps on these (this test failed)."""
    events = _wander(phi, spread, noise, student, 8000)
    assert _acted_on(StatisticalDetector().update_many(events)) == []


@pytest.mark.parametrize(
    ("spread", "noise", "seed"),
    [(0.01, 0.002, 0), (0.04, 0.002, 1), (0.06, 0.002, 2), (0.06, 0.005, 3), (0.03, 0.01, 4)],
)
def test_piecewise_shifts_of_the_data_difficulty_make_no_spike_climb_or_rise(
    spread, noise, seed
) -> None:
    """Issue 36, proportion: the data's difficulty jumps to a new level every 200-2,000 steps
    (spread 1-6 %) on 0.2-1 % step noise; each shift is 5-60 sigma of the step noise, and stays.
    A run of elevated points, or a climb, inside the run's own level moves is the data's level
    moving: an alert at most, never a spike (a rollback) or a divergence (LR cuts). Before, a
    shift of 4-6 % on 0.2 % noise was a loss_spike, then 20 points in a row a divergence."""
    rng = random.Random(seed)
    events, level = [], 0.0
    while len(events) < 8000:
        level = rng.gauss(0, spread)
        for _ in range(rng.randint(200, 2000)):
            t = len(events)
            loss = 3.0 * (1 + t / 2000) ** -0.3 * math.exp(level + rng.gauss(0, noise))
            events.append(StepEvent(run_id="r", step=t, loss=loss, time=0.0))
    verdicts = StatisticalDetector().update_many(events[:8000])
    spikes = [(v.step, v.rules) for v in verdicts if v.type == AnomalyType.LOSS_SPIKE]
    assert (spikes, _acted_on(verdicts)) == ([], [])


def _wander(phi: float, spread: float, noise: float, student: bool, n: int) -> list[StepEvent]:
    """A healthy loss (a slow power-law fall) whose data difficulty wanders: multiplicative
    AR(1) of stationary spread ``spread`` and coefficient ``phi``, on step noise ``noise``."""
    rng = random.Random(int(phi * 1000) + int(spread * 100))
    innovation = spread * math.sqrt(1.0 - phi * phi)
    wander, events = 0.0, []
    for t in range(n):
        wander = phi * wander + rng.gauss(0, innovation)
        z = rng.gauss(0, 1)
        if student:  # Student-t, 3 degrees of freedom, scaled to unit variance
            z /= math.sqrt(sum(rng.gauss(0, 1) ** 2 for _ in range(3)) / 3) * math.sqrt(3)
        loss = 3.0 * (1 + t / 2000) ** -0.3 * math.exp(wander + noise * z)
        events.append(StepEvent(run_id="r", step=t, loss=loss, time=0.0))
    return events


@pytest.mark.heavy  # ~30 s: three 6,000-step runs through the whole offline pipeline
def test_slow_wander_gets_no_false_action_through_the_pipeline_policy_and_guard() -> None:
    """The whole offline pipeline, the recovery policy and the Guard's skip rule: no stop,
    rollback, LR cut or skipped batch (before: 41-48 LR cuts per 10k steps on such runs)."""
    from spikeguard.lab.false_actions import pipeline_false_actions

    runs = [
        _wander(0.999, 0.06, 0.002, True, 6000),
        _wander(0.995, 0.03, 0.005, True, 6000),
        _wander(0.9, 0.01, 0.002, True, 6000),
    ]
    for i, run in enumerate(runs):
        runs[i] = [e.model_copy(update={"run_id": f"wander-{i}"}) for e in run]
    found = pipeline_false_actions(runs)
    assert (found.stops, found.rollbacks, found.lr_cuts, found.skipped_batches) == (0, 0, 0, 0), (
        found
    )


@pytest.mark.parametrize("seed", (0, 2))
def test_a_mixtures_hard_batches_lifting_a_window_for_a_few_steps_say_nothing(seed) -> None:
    """A stationary mixture (9-15 % of batches x1.2 harder, 0.4 % step noise) lifts the climb
    statistic (a median of 10) over its bar for a step or three when hard batches bunch. A
    climb is one only once sustained for a window; before, each such step was said as a level
    shift (an alert on a healthy run): 28 and 8 of them on these seeds."""
    rng = random.Random(seed)
    frac, hard = rng.uniform(0.09, 0.15), rng.uniform(1.15, 1.25)
    det = StatisticalDetector()
    said = []
    for i in range(4000):
        y = math.log(3.0) + rng.gauss(0, 0.004) + (math.log(hard) if rng.random() < frac else 0.0)
        v = det.update(StepEvent(run_id="r", step=i, time=float(i), loss=math.exp(y), lr=1e-3))
        if v.type is AnomalyType.SLOW_RISE:
            said.append((i, v.rules))
    assert said == []


def _steps(kind: str, noise: float, student: bool, seed: int, phi: float = 0.0) -> list[StepEvent]:
    """A healthy run whose data difficulty steps to a new level four times and stays flat after
    each step (+3 %, +7 %, -5 %, then +15 %: the last twice any move before it, the first with no
    move before it at all), on a slow power-law fall with step noise ``noise``. A ``signed`` loss
    is the same curve shifted below zero (its noise additive, no ratio of it means anything).
    ``phi``: the noise is AR(1) with that coefficient (unit variance; 0: independent steps)."""
    rng = random.Random(seed)
    shifts = ((1500, 0.03), (2700, 0.07), (3600, -0.05), (4300, 0.15))
    events = []
    e = 0.0
    for t in range(5200):
        level = sum(size for at, size in shifts if t >= at)
        z = rng.gauss(0, 1)
        if student:  # Student-t, 3 degrees of freedom, scaled to unit variance
            z /= math.sqrt(sum(rng.gauss(0, 1) ** 2 for _ in range(3)) / 3) * math.sqrt(3)
        e = z if phi == 0.0 else phi * e + math.sqrt(1.0 - phi * phi) * z
        loss = 3.0 * (1 + t / 2000) ** -0.3 * math.exp(level + noise * e)
        if kind == "signed":
            loss -= 2.0
        events.append(StepEvent(run_id=f"steps-{kind}-{seed}", step=t, loss=loss, time=float(t)))
    return events


@pytest.mark.parametrize(
    ("kind", "noise", "student", "seed"),
    [
        ("positive", 0.002, False, 0),
        ("positive", 0.05, True, 1),
        ("signed", 0.002, False, 2),
        ("signed", 0.002, True, 3),
        ("signed", 0.01, True, 4),
        ("signed", 0.05, False, 5),
    ],
)
def test_a_step_of_the_data_difficulty_that_stays_flat_never_cuts_the_lr(
    kind, noise, student, seed
) -> None:
    """Issue 36, proportion: a step is not a divergence. The level jumps and then stays flat; a
    divergence keeps rising. However large the step against the run's earlier moves (the first
    step of a run has none), the pipeline, the policy and the Guard's skip rule make no LR cut, no
    stop, and no rollback or skipped batch (a flat rise whose updates stayed bounded is no sign
    of damage: watched for its end). Before, a signed loss's steps were a `loss_climb` or 20 elevated points in a row
    (`loss_divergence`), HIGH: 2-5 LR cuts per run (test-half seed 61: a step twice any earlier
    move of its level)."""
    from spikeguard.lab.false_actions import pipeline_false_actions

    found = pipeline_false_actions([_steps(kind, noise, student, seed)])
    assert (found.stops, found.lr_cuts, found.rollbacks, found.skipped_batches) == (0, 0, 0, 0), (
        found
    )


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("kind", "noise", "phi", "seed"),
    [("signed", 0.002, 0.9, 6), ("signed", 0.01, 0.5, 7), ("positive", 0.002, 0.9, 8)],
)
def test_a_step_of_the_data_difficulty_on_correlated_noise_never_cuts_the_lr(
    kind, noise, phi, seed
) -> None:
    """The same steps on AR(1) step noise. Whether a rise has gone on rising is asked at five
    standard errors of a difference of two medians, worked out as if the points were independent
    (LevelMonitor._further): correlated noise moves a median of 10 or 50 points further than
    that, and must still not turn a flat step into a divergence."""
    from spikeguard.lab.false_actions import pipeline_false_actions

    found = pipeline_false_actions([_steps(kind, noise, False, seed, phi)])
    assert (found.stops, found.lr_cuts) == (0, 0), found


def _curriculum(seed: int, noise: float) -> list[StepEvent]:
    """A healthy run whose data gets harder in stages: +20 % at three steps far apart (a new data
    mix), flat after each, on a loss that has stopped falling; step noise ``noise``."""
    rng = random.Random(seed)
    events = []
    for t in range(20000):
        stage = t // 5000
        loss = (2.0 + 1.5 * math.exp(-t / 2000)) * 1.2**stage * math.exp(noise * rng.gauss(0, 1))
        events.append(StepEvent(run_id=f"curriculum-{seed}", step=t, loss=loss, time=float(t)))
    return events


@pytest.mark.heavy
@pytest.mark.parametrize(("seed", "noise"), [(0, 0.01), (1, 0.01), (2, 0.005), (3, 0.02)])
def test_a_harder_stage_of_the_data_is_not_a_rise_that_goes_on(seed, noise) -> None:
    """A step of the data's level crosses the rise test's bar inside a block: that first block
    over the bar holds points of both levels, so its median is below the new level, and every
    later block looked "risen further" than it, by up to the step's whole size. A step has at most
    one such block; only a rise past the second block over the bar goes on. Before, a +20 % stage
    of a flat loss on 1 % noise was a MEDIUM `loss_slow_rise`, and the policy cut the LR; and each
    run's first stage was rolled back, its batches skipped, until the re-run met it again."""
    from spikeguard.lab.false_actions import pipeline_false_actions

    found = pipeline_false_actions([_curriculum(seed, noise)])
    assert (found.stops, found.lr_cuts, found.rollbacks, found.skipped_batches) == (0, 0, 0, 0), (
        found
    )


def _stretches(seed: int, phi: float, noise: float) -> list[StepEvent]:
    """A healthy loss falling through zero to -0.05 (below zero from step ~5,400, or earlier on
    its noise: then a signed loss, whose noise alone is its scale) on AR(1) step noise of
    coefficient ``phi`` and spread ``noise``, whose data gets harder for a stretch three times
    (+0.05 to +0.3 for 60-300 steps, from steps 3,000, 5,000 and 7,000) and back: a harder
    shard that ends."""
    rng = random.Random(seed)
    stretches = [
        (at, rng.choice((0.05, 0.1, 0.2, 0.3)), rng.randint(60, 300)) for at in (3000, 5000, 7000)
    ]
    events, e = [], 0.0
    for t in range(8000):
        e = phi * e + math.sqrt(1.0 - phi * phi) * rng.gauss(0, 1)
        harder = sum(h for at, h, length in stretches if at <= t < at + length)
        loss = -0.05 + 0.3 * math.exp(-t / 3000) + noise * e + harder
        grad = math.exp(0.05 * rng.gauss(0, 1))
        events.append(
            StepEvent(run_id=f"stretch-{seed}", step=t, loss=loss, grad_norm=grad, time=float(t))
        )
    return events


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("seed", "phi", "noise"),
    [
        (0, 0.9, 0.005),
        (0, 0.5, 0.02),
        (5, 0.5, 0.02),
        (2, 0.9, 0.005),
        (20, 0.95, 0.005),
        (9, 0.95, 0.01),
        (23, 0.98, 0.01),
        (7, 0.98, 0.01),
    ],
)
def test_a_signed_losss_harder_stretch_that_ends_is_no_divergence(seed, phi, noise) -> None:
    """Issue 36, proportion, where no ratio helps: a signed loss's harder stretch is tens of its
    noise's sigmas up, flat, and ends. One point that far above a signed loss's noise was a
    `loss_divergence` whatever came before it (a positive loss's needs x10 as well), so the
    stretch's third point, the first whose update the Guard did not skip, was a HIGH
    divergence: an LR cut, then a rollback of its onset's batches, at each stretch (the first
    two runs). At its patience the spike's judging decision was a LOW level shift, which the
    policy rolled back as "still anomalous" (the third). The block rise's "still rising" bar,
    worked out as if the points were independent, made a MEDIUM slow rise of a flat stretch on
    AR(0.9) noise: an LR cut (the fourth). The elevation's own "still rising" bar, worked out
    so too, made a HIGH divergence of a flat stretch whose level wandered on AR(0.95-0.98)
    noise: an LR cut (the next three; 16 of 72 such runs cut the LR, 3 then). And a jump that
    began a run of elevated points inside an earlier elevation not yet back at its level was
    measured from that elevation's first points: the jump itself "still rising" (the last: 2
    of the 72 runs cut the LR now, both on a loss still above zero, where the stretch is x30)."""
    from spikeguard.lab.false_actions import pipeline_false_actions

    found = pipeline_false_actions([_stretches(seed, phi, noise)])
    assert (found.stops, found.lr_cuts, found.rollbacks, found.skipped_batches) == (0, 0, 0, 0), (
        found
    )


@pytest.mark.heavy
def test_a_harder_stretch_x30_of_a_loss_still_above_zero_never_stops_the_run() -> None:
    """The same generator where the loss has not yet gone below zero when its stretch comes
    (AR(0.98) step noise, 0.01 just above zero, +0.3 for 70 steps): to a positive loss that is
    x30, an extreme loss, rolled back once with its window skipped. The re-run met the rest of
    the stretch on the batches after it, every update bounded, and that second recovery of a
    critical incident stopped the run. The data's level now (PaLM's test), watched."""
    from spikeguard.lab.false_actions import pipeline_false_actions

    found = pipeline_false_actions([_stretches(0, 0.98, 0.005)])
    assert found.stops == 0 and found.rollbacks <= 1 and found.lr_cuts == 0, found
