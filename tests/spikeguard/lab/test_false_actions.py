"""False actions on healthy runs: what the policy, the Guard's skip rule and each simple rule do."""

from __future__ import annotations

import json

import pytest

from spikeguard.actuators.config import PolicyConfig
from spikeguard.cli import main
from spikeguard.lab.baselines import BASELINES, flag_run
from spikeguard.lab.false_actions import Checkpoints, FalseActions, PolicyActions, policy_actions
from spikeguard.schemas import AnomalyType, Decision, StepEvent


def healthy(step: int) -> Decision:
    return Decision(decision_id=f"d{step}", run_id="r", step=step, is_anomaly=False, time=0.0)


def critical(step: int, incident: str) -> Decision:
    return Decision(
        decision_id=f"d{step}",
        run_id="r",
        step=step,
        is_anomaly=True,
        type=AnomalyType.EXTREME_LOSS,
        confidence=1.0,
        critical=True,
        incident_id=incident,
        incident_onset_step=step,
        time=0.0,
    )


def test_a_healthy_run_gets_no_action():
    assert policy_actions([healthy(s) for s in range(1000)], "r") == PolicyActions(0, 0, 0, 0)


def test_a_critical_decision_is_answered_as_live_with_a_rollback_to_a_kept_checkpoint():
    decisions = [critical(s, "i1") if s == 600 else healthy(s) for s in range(1000)]
    actions = policy_actions(decisions, "r")
    config = PolicyConfig()
    assert actions.rollbacks == 1 and actions.stops == 0 and actions.lr_cuts == 1
    assert (
        actions.skipped_batches >= config.skip_extra_batches
    )  # the steps since the onset, and more


def test_the_same_incident_again_after_its_recovery_stops_the_run():
    decisions = [critical(s, "i1") if s in (600, 700) else healthy(s) for s in range(1000)]
    assert policy_actions(decisions, "r").stops == 1


def test_checkpoints_rotate_as_the_guards_keeping_the_newest_healthy_one():
    book = Checkpoints("r", every=50, keep=3)
    announced = [c for step in range(0, 500) for c in book.due(step, healthy=step < 200)]
    kept = [c.step for c in book.kept]
    assert kept == [150, 350, 400, 450]  # the newest three, and the newest healthy one
    assert {c.step for c in announced if c.deleted} == set(range(0, 350, 50)) - {150}


def noisy_run(path, steps: int = 600) -> list[float]:
    """A stationary, heavy-tailed loss: a chi-square with one degree of freedom, seeded."""
    import random

    rng = random.Random(0)
    losses = [0.1 * rng.gauss(0, 1) ** 2 + 0.01 for _ in range(steps)]
    path.write_text("step,loss\n" + "".join(f"{s},{v!r}\n" for s, v in enumerate(losses)))
    return losses


def test_evaluate_reports_false_actions_per_kind_next_to_the_simple_rules(tmp_path, capsys):
    noisy_run(tmp_path / "chi2.csv")
    args = [
        "evaluate",
        "--false-actions",
        str(tmp_path / "chi2.csv"),
        "--systems",
        "pipeline",
        "metaseq",
        "lightning",
        "--json",
    ]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    row = report["kinds"]["chi2"]
    assert row["steps"] == 600 and row["runs"] == 1
    assert set(row["pipeline"]["counts"]) == set(FalseActions._fields)
    losses = noisy_run(tmp_path / "again.csv")
    events = [StepEvent(run_id="chi2", step=s, loss=v) for s, v in enumerate(losses)]
    for name in ("metaseq", "lightning"):
        flagged = sum(m.is_anomaly for m in flag_run(BASELINES[name](), events))
        assert row[name]["count"] == flagged
        assert row[name]["per_10k"] == pytest.approx(flagged * 10_000 / 600)
        assert row[name]["runs_flagged"] == (flagged > 0)
    assert report["rule_actions"] == {"metaseq": "skip", "lightning": "stop"}
    assert main(args[:-1]) == 0
    text = capsys.readouterr().out
    assert "== false actions on healthy runs" in text and "lightning (stop)" in text
    assert f"({int(row['lightning']['count'] > 0)}/1)" in text


def test_false_actions_cannot_be_mixed_with_scoring(capsys):
    assert main(["evaluate", "--false-actions", "--files", "x.csv"]) == 2
    assert "cannot be combined" in capsys.readouterr().err
