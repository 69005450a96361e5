"""The prototype rules: robust outlier/spike/divergence and the CUSUM slow rise."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from spikeguard.cli.evaluate import system_marks
from spikeguard.lab.evaluation import score_run, summarize
from spikeguard.lab.proposed_rules import (
    DIVERGENCE,
    NON_FINITE,
    OUTLIER,
    SLOW_RISE,
    SPIKE,
    ProposedRules,
    RobustOutlier,
    SlowRise,
)
from spikeguard.lab.realdata import load_spike_set
from spikeguard.schemas import StepEvent

FIXTURES = Path(__file__).parents[2] / "data" / "real_spikes"


def ev(step: int, loss: float, grad: float | None = None) -> StepEvent:
    return StepEvent(run_id="p", step=step, loss=loss, grad_norm=grad, time=float(step))


def run(losses, rules=None) -> list[str]:
    rules = rules or ProposedRules()
    return [rules.update(ev(i, float(l))) for i, l in enumerate(losses)]


def noisy(n: int, seed: int = 0, level: float = 3.0, sd: float = 0.02) -> np.ndarray:
    return level * np.exp(sd * np.random.default_rng(seed).standard_normal(n))


def test_a_healed_one_step_jump_is_an_outlier_step_and_stays_out_of_the_baseline():
    losses = noisy(300)
    losses[200] = 6.0
    kinds = run(losses)
    assert kinds[200] == OUTLIER and kinds.count("") == 299


def test_it_needs_both_six_noise_units_and_a_quarter_up():
    losses = noisy(300, sd=0.001)  # very quiet: +10 % is far more than 6 noise units
    losses[200] *= 1.10
    losses[250] *= 1.30
    kinds = run(losses)
    assert kinds[200] == "" and kinds[250] == OUTLIER
    loud = noisy(300, sd=0.2)  # very noisy: x1.4 is under 6 noise units
    loud[200] = 1.4 * np.median(loud[100:200])
    assert run(loud)[200] == ""


def test_staying_up_makes_a_spike_then_a_divergence():
    losses = np.concatenate([noisy(200), [6.0] * 25])
    kinds = run(losses)
    assert kinds[200] == OUTLIER and set(kinds[201:219]) == {SPIKE} and set(kinds[219:]) == {DIVERGENCE}
    losses = np.concatenate([noisy(200), [40.0]])
    assert run(losses)[200] == DIVERGENCE  # x10 at once


def test_a_lasting_level_shift_becomes_the_new_normal():
    rule = RobustOutlier(relearn_after=50)
    kinds = [rule.update(math.log(v)) for v in np.concatenate([noisy(100), noisy(300, seed=1, level=6.0)])]
    assert SPIKE in kinds[100:150] and kinds[-1] == ""


def test_non_finite_loss_or_grad_norm():
    rules = ProposedRules()
    run(noisy(50), rules)
    assert rules.update(ev(50, math.nan)) == NON_FINITE
    assert rules.update(ev(51, 3.0, math.inf)) == NON_FINITE
    assert rules.update(ev(52, 3.0, 1.0)) == ""


def test_a_slow_rise_of_fifteen_percent_is_caught_and_a_plateau_is_not():
    rng = np.random.default_rng(3)
    n = 3000
    plateau = 3.0 * np.exp(0.03 * rng.standard_normal(n))
    assert SLOW_RISE not in run(plateau)
    rise = plateau * np.concatenate([np.ones(1000), np.linspace(1.0, 1.15, 2000)])
    kinds = run(rise)
    first = kinds.index(SLOW_RISE)
    assert 1000 < first < 3000
    assert rise[first] / 3.0 < 1.2  # caught before the rise is over


def test_the_best_level_is_never_forgotten():
    rule = SlowRise(warmup=1)
    for _ in range(10):
        rule.update(0.0, 0.0, 0.01)
    for _ in range(10_000):  # a long stretch 3 % up: under the 5 % allowance
        assert rule.update(0.03, 0.03, 0.01) is False
    assert rule.best == 0.0 and rule.cusum == 0.0
    hits = [rule.update(0.10, 0.10, 0.01) for _ in range(30)]  # ~10 % up: ~5 units over per point
    excess = (0.10 - math.log(1.05)) / 0.01
    assert hits.index(True) == math.floor(100 / excess)  # the first point where the sum passes 100


def test_on_the_real_fixture_it_finds_all_but_the_dlrm_warm_up_spikes():
    runs = load_spike_set(FIXTURES)
    scores = [score_run([e.step for e in r.events], r.labels, system_marks("proposed", r.events))
              for r in runs]
    summary = summarize(scores)
    assert summary.episodes == 8 and summary.detected == 6 and summary.precision == 1.0
    assert summary.by_kind["outlier_step"]["recall"] == 1.0
    assert summary.by_kind["divergence"]["recall"] == 1.0
    assert summary.by_kind["spike"]["detected"] == 3  # the two missed are in the DLRM run's first 36 steps


@pytest.mark.parametrize("kind", [OUTLIER, SPIKE, DIVERGENCE])
def test_marks_carry_the_kind(kind):
    tail = {OUTLIER: [6.0], SPIKE: [6.0, 6.0], DIVERGENCE: [60.0]}[kind]
    events = [ev(i, float(v)) for i, v in enumerate(np.concatenate([noisy(200), tail]))]
    marks = system_marks("proposed", events)
    assert marks[-1].is_anomaly and marks[-1].type == kind
    assert not any(m.is_anomaly for m in marks[:200])
