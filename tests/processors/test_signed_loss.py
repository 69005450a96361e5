"""A loss that goes below zero (a Poisson or Gaussian NLL, an ELBO) has no natural zero.

Judged in log space through a floor, every positive batch of a loss whose level is below zero read
as a jump of ~25 log units: a healthy Gaussian NLL run got 14 LR cuts and 26 skipped updates, a
Poisson regression 4 LR cuts and a rollback of 204 batches. From its first negative value such a
loss is judged on itself, against its own noise; no ratio of it is taken anywhere.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from spikeguard.processors.detectors.rules import RulesDetector
from spikeguard.processors.detectors.statistical import StatisticalDetector
from spikeguard.processors.outlier_model import OutlierModel, position, turns_signed
from spikeguard.producers.skip_rule import SkipRule
from spikeguard.schemas import AnomalyType, StepEvent

STEPS = 5000


def signed_run(seed: int, level: float, scale: float, dof: float) -> np.ndarray:
    """A healthy loss that falls from above zero to ``level`` and stays there, with heavy-tailed
    (Student-t) noise of ``scale``: its batches cross zero both ways."""
    rng = np.random.default_rng(seed)
    t = np.arange(STEPS)
    trend = level + (1.0 - level) * np.exp(-t / 60.0)
    return trend + scale * rng.standard_t(dof, STEPS)


RUNS = [
    pytest.param(0, -0.9, 0.25, 4.0, id="gaussian-nll-like"),
    pytest.param(1, -20.0, 6.0, 3.0, id="poisson-like"),
    pytest.param(2, -0.05, 0.2, 5.0, id="level-near-zero"),
]


def test_the_first_negative_value_turns_the_model_signed_and_a_zero_does_not() -> None:
    assert not turns_signed(0.0, False) and not turns_signed(1.0, False)
    assert turns_signed(-1e-9, False) and not turns_signed(-1.0, True)
    assert position(-2.0, True) == -2.0 and position(math.e, False) == pytest.approx(1.0)


def test_a_signed_model_judges_only_a_settled_tail_and_round_trips() -> None:
    model, rng = OutlierModel(signed=True), np.random.default_rng(3)
    judged = []
    for x in -1.0 + 0.1 * rng.standard_normal(600):
        point = model.judge(float(x))
        judged.append(point.judged)
        model.advance(float(x), point)
    first = judged.index(True)
    assert first >= model.config.settle and all(judged[first:])
    twin = OutlierModel()
    twin.load_state_dict(model.state_dict())
    assert twin.signed and twin.threshold() == model.threshold()
    # No floor in log units: the threshold is the noise's own, a fraction of a loss unit here.
    assert 0.2 < model.threshold() < 1.0


@pytest.mark.parametrize("seed, level, scale, dof", RUNS)
def test_a_healthy_signed_loss_is_left_alone(seed, level, scale, dof) -> None:
    losses = signed_run(seed, level, scale, dof)
    rule, statistical, rules = SkipRule(), StatisticalDetector(), RulesDetector()
    skips, anomalies = 0, []
    for step, loss in enumerate(losses):
        skips += rule.decide(float(loss), 1.0).skip
        event = StepEvent(run_id="r", step=step, loss=float(loss), grad_norm=1.0, time=0.0)
        for detector in (statistical, rules):
            verdict = detector.update(event)
            if verdict.is_anomaly:
                anomalies.append((step, detector.name, verdict.type))
    assert skips <= 0.001 * STEPS, skips  # before: 3 % to 40 % of the steps
    # At most a lone outlier step (its update skipped, nothing else done): Student-t noise of
    # 3 dof reaches 19 scales once in 7,000 steps.
    assert all(kind == AnomalyType.OUTLIER_STEP for _, _, kind in anomalies), anomalies[:5]
    assert len(anomalies) <= 1, anomalies


@pytest.mark.parametrize("seed, level, scale, dof", RUNS)
def test_a_spike_of_a_signed_loss_is_found_and_skipped(seed, level, scale, dof) -> None:
    losses = signed_run(seed, level, scale, dof)
    # Three bad batches, 100 noise scales up: beyond what the heaviest of these noises (Student-t,
    # 3 dof: once in 100,000 steps 40 scales up) reaches.
    losses[3000:3003] += 100.0 * scale
    rule, statistical = SkipRule(), StatisticalDetector()
    skipped, found = [], []
    for step, loss in enumerate(losses):
        if rule.decide(float(loss), 1.0).skip:
            skipped.append(step)
        verdict = statistical.update(
            StepEvent(run_id="r", step=step, loss=float(loss), grad_norm=1.0, time=0.0)
        )
        if verdict.is_anomaly:
            found.append(step)
    assert {3000, 3001} <= set(skipped)
    assert 3000 in found


def test_only_a_finite_negative_loss_makes_a_run_signed_for_the_rules() -> None:
    """A loss of -inf is a non-finite step of a positive loss, not a loss without a zero: the
    ratio rule still finds the extreme loss after it."""
    rules = RulesDetector()
    for step in range(200):
        rules.update(StepEvent(run_id="r", step=step, loss=2.0 + 0.01 * (step % 7), time=0.0))
    rules.update(StepEvent(run_id="r", step=200, loss=-math.inf, time=0.0))
    assert "loss_ratio" in rules.update(StepEvent(run_id="r", step=201, loss=500.0, time=0.0)).rules
    rules.update(StepEvent(run_id="r", step=202, loss=-0.5, time=0.0))
    assert (
        "loss_ratio"
        not in rules.update(StepEvent(run_id="r", step=203, loss=500.0, time=0.0)).rules
    )


def mostly_zero_run(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A hinge-like loss once learnt: zero (and a zero gradient) on 95 % of the batches, a
    heavy-tailed small positive loss on the rest."""
    rng = np.random.default_rng(seed)
    positive = rng.random(STEPS) < 0.05
    losses = np.where(positive, 0.005 * rng.lognormal(0.0, 1.0, STEPS), 0.0)
    grads = np.where(positive, 0.3 * rng.lognormal(0.0, 0.3, STEPS), 0.0)
    return losses, grads


@pytest.mark.parametrize("seed", [0, 1])
def test_a_loss_that_is_zero_on_most_batches_is_left_alone_and_its_spike_found(seed) -> None:
    """A zero has no log: through the floor, each nonzero batch read as a jump of ~25 log units
    (a real multi-margin classifier, batch 8: 16-20 LR cuts and a rollback in 5,000 steps). Zeros
    are neither judged nor learnt; the nonzero batches are judged among themselves."""
    losses, grads = mostly_zero_run(seed)
    losses[4000:4003], grads[4000:4003] = 5.0, 30.0  # three bad batches
    rule, statistical = SkipRule(), StatisticalDetector()
    skipped, found = [], []
    for step, (loss, grad) in enumerate(zip(losses, grads)):
        if rule.decide(float(loss), float(grad)).skip:
            skipped.append(step)
        event = StepEvent(run_id="r", step=step, loss=float(loss), grad_norm=float(grad), time=0.0)
        if statistical.update(event).is_anomaly:
            found.append(step)
    assert [s for s in skipped if s < 4000] == [] and 4000 in skipped
    assert [s for s in found if s < 4000] == [] and 4000 in found


def test_a_signed_run_resumes_from_its_saved_state_as_if_never_stopped() -> None:
    """The signed flag and the power-law tail live in the saved state: a worker or a Guard that
    restarts mid-run judges the rest of it exactly as the one that never stopped."""
    losses = signed_run(4, -0.9, 0.25, 4.0)
    losses[3000:3003] += 25.0
    events = [
        StepEvent(run_id="r", step=s, loss=float(x), grad_norm=1.0, time=0.0)
        for s, x in enumerate(losses)
    ]
    whole, rule = StatisticalDetector(), SkipRule()
    straight = [whole.update(e) for e in events]
    skips = [rule.decide(float(x), 1.0) for x in losses]
    first, head_rule = StatisticalDetector(), SkipRule()
    for e in events[:2000]:
        first.update(e)
        head_rule.decide(e.loss, 1.0)
    resumed, tail_rule = StatisticalDetector(), SkipRule()
    resumed.load_state_dict(first.state_dict())
    tail_rule.load_state_dict(head_rule.state_dict())
    assert [resumed.update(e) for e in events[2000:]] == straight[2000:]
    assert [tail_rule.decide(float(x), 1.0) for x in losses[2000:]] == skips[2000:]
    assert any(v.is_anomaly for v in straight[3000:3003])
