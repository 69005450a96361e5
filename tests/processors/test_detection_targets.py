"""The detection targets, on a fixed-seed slice of the labelled synthetic suite.

statistical + rules + fusion, scored by ``processors.evaluation`` against both
baselines (~170k steps). (With the default fusion weights the ml detector cannot raise an
anomaly on its own and the predictor only warns, so they do not change which
steps are anomalous; they are left out to keep this test fast.)

The simulator has no one-step-outlier class: its benign noise includes one-step
jumps of up to x2 (heavy tails, eval bumps), which the statistical detector now
reports as ``outlier_step`` (low urgency: the guard skips that one update, the
policy never recovers from it). The targets here are about incidents, so those
marks are scored apart (like ``spikeguard evaluate --incidents-only``), and their
rate on the clean runs is held to a bound of its own.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from spikeguard.lab.baselines import NaiveBaseline, SixSigmaBaseline, flag_run
from spikeguard.processors.detectors.rules import RulesDetector
from spikeguard.processors.detectors.statistical import StatisticalDetector
from spikeguard.lab.evaluation import marks_from_decisions, score_run, summarize
from spikeguard.processors.fusion import Fusion
from spikeguard.processors.fusion_config import FusionConfig
from spikeguard.lab.simulate import ANOMALY_KINDS, default_suite

pytestmark = pytest.mark.heavy  # every test reads the ~170k steps the module fixture decides
SEEDS = (0, 1, 2)
OUTLIER = "outlier_step"
SKIPS: dict[str, list] = defaultdict(list)  # the outlier-step marks alone, filled by `scores`


def decide(events):
    detectors = [StatisticalDetector(), RulesDetector()]
    fusion = Fusion(FusionConfig(expected=[d.name for d in detectors]), run_id=events[0].run_id)
    verdicts = [d.update_many(events) for d in detectors]
    # Each step's verdicts in turn, as the workers hand them over; add_many decides as add does.
    return (
        fusion.add_many([v for per_step in zip(*verdicts) for v in per_step], 0.0) + fusion.flush()
    )


@pytest.fixture(scope="module")
def scores():
    ours, naive, six = defaultdict(list), defaultdict(list), defaultdict(list)
    for item in default_suite(SEEDS):
        run = item.generate()
        steps = [e.step for e in run.events]
        decisions = decide(run.events)
        assert [d.step for d in decisions] == steps  # one decision per step, in order
        marks = marks_from_decisions(decisions)
        ours[item.scenario].append(
            score_run(steps, run.labels, [m for m in marks if m.type != OUTLIER])
        )
        SKIPS[item.scenario].append(
            score_run(steps, run.labels, [m for m in marks if m.type == OUTLIER])
        )
        if item.scenario in ANOMALY_KINDS:  # (baselines skip the clean runs: it only flatters them)
            naive[item.scenario].append(
                score_run(steps, run.labels, flag_run(NaiveBaseline(), run.events))
            )
            six[item.scenario].append(
                score_run(steps, run.labels, flag_run(SixSigmaBaseline(), run.events))
            )
    return ours, naive, six


def overall(by_scenario):
    return summarize(s for runs in by_scenario.values() for s in runs)


def test_overall_targets(scores) -> None:
    ours, _, _ = scores
    s = overall(ours)
    assert s.episodes >= 50
    assert s.recall >= 0.95, s.as_dict()
    assert s.precision >= 0.9, s.as_dict()
    assert s.false_alarms_per_10k <= 0.5, s.as_dict()


def test_non_finite_values_are_all_caught_at_their_step(scores) -> None:
    s = overall(scores[0])
    nf = s.by_kind["non_finite"]
    assert nf["episodes"] >= 10 and nf["recall"] == 1.0 and nf["median_delay"] == 0


@pytest.mark.parametrize("kind", ["sudden_spike", "grad_explosion"])
def test_sudden_problems_are_caught_within_a_step(scores, kind: str) -> None:
    k = overall(scores[0]).by_kind[kind]
    assert k["recall"] >= 0.95 and k["median_delay"] <= 1


@pytest.mark.parametrize("scenario", ["stable", "heavy_tailed", "data_shift", "eval_bumps"])
def test_clean_runs_stay_quiet(scores, scenario: str) -> None:
    s = summarize(scores[0][scenario])
    assert s.false_alarms_per_10k <= 0.5, s.as_dict()


def test_outlier_steps_on_clean_runs_are_rare(scores) -> None:
    # At most one skipped update per ~500 steps on the clean scenarios (nearly all
    # heavy_tailed's and eval_bumps' x1.3-x2 jumps).
    clean = summarize(
        s for name in ("stable", "heavy_tailed", "data_shift", "eval_bumps") for s in SKIPS[name]
    )
    assert clean.alarm_episodes > 0  # the heavy-tailed jumps are seen and said
    assert clean.false_alarms_per_10k <= 20.0, clean.as_dict()
    # measured 10.1 (11 of the simulator's benign one-step blips, 8-22 sigma, up to x2: outliers
    # by the run's own noise, ~0.1 % of steps skipped, inside the 0.5 % budget)
    assert summarize(SKIPS["stable"]).false_alarms_per_10k <= 12.0


@pytest.mark.parametrize("scenario", ANOMALY_KINDS)
def test_beats_both_baselines_on_every_scenario(scores, scenario: str) -> None:
    ours, naive, six = scores
    mine = summarize(ours[scenario]).f1
    for baseline in (naive, six):
        theirs = summarize(baseline[scenario]).f1 or 0.0
        assert mine > theirs, (scenario, mine, theirs)


def test_beats_both_baselines_overall(scores) -> None:
    ours, naive, six = scores
    assert overall(ours).f1 > max(overall(naive).f1, overall(six).f1)
