"""``spikeguard replay`` re-judges with the recorded settings and prints what changes."""

from __future__ import annotations

import math

import pytest

from spikeguard.cli import main
from spikeguard.reporting import recorded_settings
from spikeguard.reporting.diff import diff_actions, diff_decisions, render
from spikeguard.runtime import open_runtime
from spikeguard.schemas import (
    Action,
    ActionKind,
    CheckpointEvent,
    Decision,
    StepEvent,
    Urgency,
    encode,
)
from spikeguard.settings import load_settings
from spikeguard.schemas.signing import sign, sign_step


def healthy_loss(step: int) -> float:
    return 3.0 * (step + 10) ** -0.3 * (1 + 0.01 * math.sin(step * 1.7))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, wait_until, consumed_by):
    """400 steps with NaNs at 300 and 301 (a non-finite step that recurs: the policy rolls back
    at the second) and healthy checkpoints every 50 steps, recorded live with a non-default
    setting (skip_extra_batches=25) that the replay must reuse."""
    directory = tmp_path_factory.mktemp("rec")
    settings = load_settings({"data_dir": str(directory), "policy.skip_extra_batches": 25}, env={})
    with open_runtime(settings) as runtime:
        producer = runtime.bus.producer()
        for step in range(400):
            loss = math.nan if step in (300, 301) else healthy_loss(step)
            producer.publish(
                runtime.topics.steps,
                encode(
                    sign_step(
                        StepEvent(run_id="rec", step=step, loss=loss), runtime.settings.signing_key
                    )
                ),
                key="rec",
            )
            if step % 50 == 0 and 0 < step < 300:
                producer.publish(
                    runtime.topics.checkpoints,
                    encode(
                        sign(
                            CheckpointEvent(  # as the trainer signs
                                run_id="rec", step=step, checkpoint_id=f"c{step}", healthy=True
                            ),
                            runtime.settings.signing_key,
                        )
                    ),
                    key="rec",
                )
        producer.flush()
        wait_until(
            lambda: len(runtime.bus.read_all(runtime.topics.decisions)) >= 400,
            "a decision on every step",
        )
        decided = len(runtime.bus.read_all(runtime.topics.decisions))
        wait_until(
            lambda: consumed_by(runtime, "actuator", runtime.topics.decisions) >= decided,
            "the actuator took in every decision",
        )
    return directory


def test_the_settings_are_recorded_beside_the_run(recorded):
    saved = recorded_settings.load(recorded)
    assert saved["policy.skip_extra_batches"] == 25
    assert not any(key.startswith(("bootstrap", "signing", "sasl")) for key in saved)
    assert "signing_key" not in (recorded / "_settings.json").read_text()


def test_replay_with_the_recorded_settings_finds_no_difference(recorded, capsys):
    assert main(["replay", "--data-dir", str(recorded)]) == 0
    out = capsys.readouterr().out
    assert "judged with the recorded settings" in out
    assert "decisions: 0 added, 0 removed, 0 changed" in out
    assert "actions: 0 added, 0 removed, 0 changed" in out
    assert "no differences" in out


def test_today_s_defaults_would_change_the_skip(recorded, capsys):
    assert main(["replay", "--data-dir", str(recorded), "--current-settings"]) == 0
    out = capsys.readouterr().out
    assert "judged with today's settings" in out
    assert "~ run rec skip_batches at step 302:" in out and "extra=25" in out


def test_a_set_flag_that_removes_the_rollback_is_named(recorded, capsys):
    assert (
        main(
            [
                "replay",
                "--data-dir",
                str(recorded),
                "--set",
                "policy.rollback_min_steps_before_onset=400",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "changed: policy.rollback_min_steps_before_onset" in out
    assert "decisions: 0 added, 0 removed, 0 changed" in out
    assert "  - run rec rollback at step 302 (checkpoint_id=c200, target_step=200)" in out
    assert "a rollback vanishes: run rec at step 302" in out


def test_render_names_changed_decisions_and_appearing_rollbacks():
    before = [
        Decision(
            decision_id="a",
            run_id="r",
            step=5,
            is_anomaly=True,
            type="loss_spike",
            urgency=Urgency.HIGH,
        )
    ]
    after = [
        Decision(
            decision_id="b",
            run_id="r",
            step=5,
            is_anomaly=True,
            type="non_finite",
            urgency=Urgency.CRITICAL,
        ),
        Decision(decision_id="c", run_id="r", step=9, is_anomaly=True, urgency=Urgency.LOW),
    ]
    actions = [
        Action(
            action_id="x",
            run_id="r",
            kind=ActionKind.ROLLBACK,
            apply_at_step=6,
            params={"target_step": 1},
        )
    ]
    lines = render(diff_decisions(before, after), diff_actions([], actions))
    assert lines[0] == "decisions: 1 added, 0 removed, 1 changed"
    assert "  ~ run r step 5 (epoch 0): loss_spike, high -> non_finite, critical" in lines
    assert "  + run r step 9 (epoch 0): none, low" in lines
    assert "a rollback appears: run r at step 6" in lines


def test_a_set_flag_is_applied_and_a_change_that_changes_nothing_says_so(
    recorded, capsys, monkeypatch
):
    # Issue 38: `--set fusion.threshold=0.5` printed "no differences" and left the user asking
    # whether the setting was applied at all.
    import spikeguard.lab.backtest as backtest

    judged_with = []
    real = backtest.replay_events

    def spy(steps, checkpoints, settings, acks=()):
        judged_with.append(settings)
        return real(steps, checkpoints, settings, acks)

    monkeypatch.setattr(backtest, "replay_events", spy)
    argv = ["replay", "--data-dir", str(recorded), "--set", "fusion.threshold=0.5"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert [s.fusion.threshold for s in judged_with] == [0.5]
    assert judged_with[0].policy.skip_extra_batches == 25  # the rest as recorded
    assert "no differences: with fusion.threshold=0.5 every step is judged as recorded" in out


def test_the_signature_line_does_not_contradict_itself_without_a_key(recorded, capsys):
    assert main(["replay", "--data-dir", str(recorded)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("signatures NOT checked (no signing key)")
    assert "every record is signed" not in first
    assert "every record carries a signature, unverified" in first, first
