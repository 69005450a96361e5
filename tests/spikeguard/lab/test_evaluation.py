"""Scoring: episodes, alarm episodes, delays, lead times and the summary numbers."""

from __future__ import annotations

import pytest

from spikeguard.lab.evaluation import (
    Episode,
    EvaluationConfig,
    Mark,
    episodes_from_labels,
    marks_from_decisions,
    merge,
    score_run,
    summarize,
)
from spikeguard.lab.runfile import StepLabel
from spikeguard.schemas import AnomalyType, Decision, decision_id

N = 1000
STEPS = list(range(N))


def labels(*spans: tuple[int, int, str]) -> list[StepLabel]:
    out = [StepLabel(False, "")] * N
    for start, end, kind in spans:
        for i in range(start, end + 1):
            out[i] = StepLabel(True, kind)
    return out


def alarms(*steps: int, preventive: bool = False, kind: str = "loss_spike") -> list[Mark]:
    hit = set(steps)
    return [Mark(s, s in hit, preventive and s in hit, kind if s in hit else "none") for s in STEPS]


def test_episodes_split_on_gaps_and_on_kind_changes():
    lab = labels((10, 12, "sudden_spike"), (13, 14, "non_finite"), (20, 20, "sudden_spike"))
    assert episodes_from_labels(STEPS, lab) == [
        Episode(10, 12, "sudden_spike"),
        Episode(13, 14, "non_finite"),
        Episode(20, 20, "sudden_spike"),
    ]
    assert episodes_from_labels(STEPS, labels((990, 999, "divergence"))) == [
        Episode(990, 999, "divergence")
    ]


def test_merge_joins_alarms_within_the_gap():
    assert merge([1, 2, 8, 20, 26], gap=5) == [(1, 8), (20, 26)]
    assert merge([1, 7], gap=5) == [(1, 7)] and merge([1, 8], gap=5) == [(1, 1), (8, 8)]


def test_detection_delay_and_tolerances():
    lab = labels(
        (100, 100, "sudden_spike"), (300, 310, "gradual_spike"), (500, 500, "sudden_spike")
    )
    score = score_run(STEPS, lab, alarms(101, 299, 507))  # late by 1; early by 1; too late
    results = {r.episode.start: r for r in score.episodes}
    assert results[100].detected and results[100].delay == 1
    assert results[300].detected and results[300].delay == 0  # within pre-tolerance: on time
    assert not results[500].detected and results[500].delay is None
    assert score.alarm_episodes == 3 and score.false_alarm_episodes == 1  # 507 > 500 + 5


def test_non_finite_needs_an_alarm_at_its_first_step():
    lab = labels((200, 202, "non_finite"), (400, 400, "non_finite"))
    score = score_run(STEPS, lab, alarms(201, 400))
    detected = {r.episode.start: r.detected for r in score.episodes}
    assert detected == {200: False, 400: True}
    assert score.false_alarm_episodes == 0  # the late alarm still overlaps the episode


def test_precision_recall_f1_and_false_alarm_rate():
    lab = labels((100, 105, "sudden_spike"), (600, 650, "divergence"))
    # one true alarm episode (100-104 merged), two false ones, the divergence missed
    score = score_run(STEPS, lab, alarms(100, 102, 104, 300, 800))
    s = summarize([score])
    assert (s.episodes, s.detected, s.alarm_episodes, s.false_alarm_episodes) == (2, 1, 3, 2)
    assert s.recall == 0.5 and s.precision == pytest.approx(1 / 3)
    assert s.f1 == pytest.approx(2 * 0.5 * (1 / 3) / (0.5 + 1 / 3))
    clean_steps = N - 6 - 51
    assert s.clean_steps == clean_steps
    assert s.false_alarms_per_10k == pytest.approx(2 * 10_000 / clean_steps)
    assert s.median_delay == 0 and s.by_kind["divergence"]["recall"] == 0.0


def test_clean_runs_have_no_recall_and_count_false_alarms():
    quiet = summarize([score_run(STEPS, None, alarms())])
    assert quiet.recall is None and quiet.precision is None and quiet.f1 is None
    assert quiet.false_alarms_per_10k == 0.0
    noisy = summarize([score_run(STEPS, None, alarms(10, 500))])
    assert noisy.precision == 0.0 and noisy.false_alarms_per_10k == pytest.approx(20.0)


def test_missed_everything_gives_f1_zero():
    s = summarize([score_run(STEPS, labels((100, 110, "oscillation")), alarms())])
    assert s.recall == 0.0 and s.precision is None and s.f1 == 0.0


def test_warnings_give_lead_time_and_are_not_alarms():
    lab = labels((300, 305, "grad_explosion"))
    marks = alarms(270, 280, preventive=True, kind="instability_warning")
    marks[300] = Mark(300, True, False, "gradient_explosion")
    marks[700] = Mark(700, True, False, "instability_warning")  # a warning for nothing
    score = score_run(STEPS, lab, marks)
    (result,) = score.episodes
    assert result.detected and result.delay == 0 and result.lead == 30
    assert score.alarm_episodes == 1 and score.false_alarm_episodes == 0
    assert score.warning_episodes == 3 and score.false_warning_episodes == 1  # 270, 280, 700
    s = summarize([score])
    assert s.median_lead == 30 and s.warned == 1 and s.false_warnings_per_10k > 0


def test_warnings_too_early_give_no_lead():
    lab = labels((300, 305, "grad_explosion"))
    marks = alarms(200, preventive=True, kind="instability_warning")
    (result,) = score_run(STEPS, lab, marks, EvaluationConfig(lookback=50)).episodes
    assert result.lead is None


def test_decisions_become_marks():
    def decision(step, **kw):
        return Decision(decision_id=decision_id("r", step), run_id="r", step=step, **kw)

    marks = marks_from_decisions(
        [
            decision(1, is_anomaly=False),
            decision(2, is_anomaly=True, type=AnomalyType.LOSS_SPIKE),
            decision(3, is_anomaly=True, type=AnomalyType.INSTABILITY_WARNING),
            decision(4, is_anomaly=False, preventive=True, type=AnomalyType.LR_TOO_HIGH),
        ]
    )
    assert marks[1] == Mark(2, True, False, "loss_spike")
    lab = [StepLabel(False, "")] * 5
    score = score_run(range(5), lab, marks)
    assert score.alarm_episodes == 1 and score.warning_episodes == 1  # steps 3-4 merge


def test_config_is_validated():
    with pytest.raises(ValueError, match="merge_gap"):
        EvaluationConfig(merge_gap=-1)
