"""The detection targets, on a fixed-seed slice of the labelled synthetic suite.

statistical + rules + fusion, scored by ``processors.evaluation`` against both
baselines (~170k steps). (With the default fusion weights the ml detector cannot raise an
anomaly on its own and the predictor only warns, so they do not change which
steps are anomalous; they are left out to keep this test fast.)
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from spikeguard.lab.baselines import NaiveBaseline, SixSigmaBaseline, flag_run
from spikeguard.processors.detectors.rules import RulesDetector
from spikeguard.processors.detectors.statistical import StatisticalDetector
from spikeguard.lab.evaluation import marks_from_decisions, score_run, summarize
from spikeguard.processors.fusion import Fusion, FusionConfig
from spikeguard.lab.simulate import ANOMALY_KINDS, default_suite

SEEDS = (0, 1, 2)


def decide(events):
    detectors = [StatisticalDetector(), RulesDetector()]
    fusion = Fusion(FusionConfig(expected=[d.name for d in detectors]), run_id=events[0].run_id)
    verdicts = [d.update_many(events) for d in detectors]
    out = []
    for i in range(len(events)):
        for per_detector in verdicts:
            out += fusion.add(per_detector[i], 0.0)
    return out + fusion.flush()


@pytest.fixture(scope="module")
def scores():
    ours, naive, six = defaultdict(list), defaultdict(list), defaultdict(list)
    started = time.perf_counter()
    for item in default_suite(SEEDS):
        run = item.generate()
        steps = [e.step for e in run.events]
        decisions = decide(run.events)
        assert [d.step for d in decisions] == steps  # one decision per step, in order
        ours[item.scenario].append(score_run(steps, run.labels, marks_from_decisions(decisions)))
        if item.scenario in ANOMALY_KINDS:  # (baselines skip the clean runs: it only flatters them)
            naive[item.scenario].append(score_run(steps, run.labels, flag_run(NaiveBaseline(), run.events)))
            six[item.scenario].append(score_run(steps, run.labels, flag_run(SixSigmaBaseline(), run.events)))
    elapsed = time.perf_counter() - started
    return ours, naive, six, elapsed


def overall(by_scenario):
    return summarize(s for runs in by_scenario.values() for s in runs)


def test_overall_targets(scores) -> None:
    ours, _, _, _ = scores
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


@pytest.mark.parametrize("scenario", ANOMALY_KINDS)
def test_beats_both_baselines_on_every_scenario(scores, scenario: str) -> None:
    ours, naive, six, _ = scores
    mine = summarize(ours[scenario]).f1
    for baseline in (naive, six):
        theirs = summarize(baseline[scenario]).f1 or 0.0
        assert mine > theirs, (scenario, mine, theirs)


def test_beats_both_baselines_overall(scores) -> None:
    ours, naive, six, elapsed = scores
    assert overall(ours).f1 > max(overall(naive).f1, overall(six).f1)
    assert elapsed < 120  # keep this test cheap enough for CI
