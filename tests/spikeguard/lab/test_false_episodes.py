"""False alarm episodes by source: the same episodes the scoring counts false, each named."""

from __future__ import annotations

from spikeguard.lab.evaluation import marks_from_decisions, score_run
from spikeguard.lab.false_episodes import GUARD_SKIP, FalseEpisode, false_episodes, tally
from spikeguard.lab.runfile import StepLabel
from spikeguard.schemas import AnomalyType, Decision, Urgency


def decision(step: int, kind: AnomalyType, urgency: Urgency, rule: str) -> Decision:
    return Decision(
        decision_id=f"d{step}",
        time=0.0,
        run_id="r",
        step=step,
        is_anomaly=True,
        type=kind,
        confidence=0.9,
        urgency=urgency,
        flagged_by={"statistical": kind},
        rules=[rule],
    )


def test_false_episodes_are_the_ones_scored_false_each_with_its_sources():
    steps = list(range(200))
    labels = [StepLabel(50 <= s <= 52, "spikes" if 50 <= s <= 52 else "") for s in steps]
    shift = decision(100, AnomalyType.SLOW_RISE, Urgency.LOW, "loss_level_shift")
    decisions = [
        decision(51, AnomalyType.LOSS_SPIKE, Urgency.MEDIUM, "loss_spike"),  # true
        shift,
        decision(103, AnomalyType.OUTLIER_STEP, Urgency.LOW, "loss_outlier_step"),
    ]
    found = false_episodes(steps, labels, decisions, local_skips=[103, 150])
    assert found == [
        FalseEpisode(
            100,
            103,
            "guard_skip + outlier_step|low|statistical|loss_outlier_step"
            " + slow_rise|low|statistical|loss_level_shift",
        ),
        FalseEpisode(150, 150, GUARD_SKIP),
    ]
    assert tally(found + [FalseEpisode(160, 160, GUARD_SKIP)])[0] == (GUARD_SKIP, 2)
    score = score_run(steps, labels, marks_from_decisions(decisions) + _skips([103, 150]))
    assert score.false_alarm_episodes == len(found)


def _skips(steps):
    from spikeguard.lab.evaluation import Mark

    return [Mark(s, True, type="outlier_step") for s in steps]
