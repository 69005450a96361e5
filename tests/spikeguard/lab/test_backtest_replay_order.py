"""Replay hands the actuator each checkpoint when the live run did, not all up front."""

from __future__ import annotations

import math

import pytest

from spikeguard.cli import main
from spikeguard.runtime import open_runtime
from spikeguard.schemas import Action, CheckpointEvent, StepEvent, Topics, encode
from spikeguard.settings import load_settings
from spikeguard.schemas.signing import sign, sign_step


def healthy_loss(step: int) -> float:
    return 3.0 * (step + 10) ** -0.3 * (1 + 0.01 * math.sin(step * 1.7))


def checkpoint(step: int, deleted: bool = False) -> CheckpointEvent:
    return CheckpointEvent(
        run_id="rec", step=step, checkpoint_id=f"c{step}", healthy=True, deleted=deleted
    )


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, wait_until, consumed_by):
    """A live run whose trainer keeps its last two checkpoints, as the guard announces them:
    a checkpoint of step s after step s - 1, and the one rotated out right after it.
    NaNs at 300 and 301 (a non-finite step that recurs; one alone the Guard's skip answers)
    roll back to c200 (100 steps before the onset); only after that rollback does c350
    arrive, rotating c200 out."""
    directory = tmp_path_factory.mktemp("rec")
    settings = load_settings({"data_dir": str(directory)}, env={})
    with open_runtime(settings) as runtime:
        producer = runtime.bus.producer()
        topics = runtime.topics
        kept: list[int] = []

        def publish_checkpoint(step: int) -> None:
            # Signed, as the trainer signs its checkpoint events: the actuator takes no others.
            key = runtime.settings.signing_key
            producer.publish(topics.checkpoints, encode(sign(checkpoint(step), key)), key="rec")
            kept.append(step)
            while len(kept) > 2:
                gone = kept.pop(0)
                producer.publish(
                    topics.checkpoints, encode(sign(checkpoint(gone, deleted=True), key)), key="rec"
                )

        def publish_step(step: int) -> None:
            loss = math.nan if step in (300, 301) else healthy_loss(step)
            # The embedded runtime has its own key: the trainer signs its steps.
            event = sign_step(
                StepEvent(run_id="rec", step=step, loss=loss), runtime.settings.signing_key
            )
            producer.publish(topics.steps, encode(event), key="rec")
            if (step + 1) % 50 == 0 and step + 1 != 300:
                publish_checkpoint(step + 1)

        for step in range(302):
            publish_step(step)
        producer.flush()

        def rolled_back() -> bool:
            return any(
                record.decoded(Action).kind.value == "rollback"
                for record in runtime.bus.read_all(topics.actions)
            )

        wait_until(rolled_back, "the NaNs rolled back")
        for step in range(302, 400):
            publish_step(step)
        producer.flush()
        wait_until(
            lambda: len(runtime.bus.read_all(topics.decisions)) >= 400, "a decision on every step"
        )
        decided = len(runtime.bus.read_all(runtime.topics.decisions))
        wait_until(
            lambda: consumed_by(runtime, "actuator", runtime.topics.decisions) >= decided,
            "the actuator took in every decision",
        )
    return directory


def test_a_recorded_rollback_replays_with_no_differences(recorded, capsys):
    assert main(["replay", "--data-dir", str(recorded)]) == 0
    out = capsys.readouterr().out
    assert "actions: 0 added, 0 removed, 0 changed" in out
    assert "vanishes" not in out
    assert "no differences" in out


def test_a_checkpoint_goes_in_before_the_step_it_precedes_with_its_deletions():
    from spikeguard.lab.backtest import interleave

    topics = Topics()
    steps = [StepEvent(run_id="rec", step=s, loss=1.0) for s in range(6)]
    other = StepEvent(run_id="other", step=0, loss=1.0)
    checkpoints = [checkpoint(2), checkpoint(4), checkpoint(2, deleted=True), checkpoint(9)]
    segments = list(interleave([*steps[:3], other, *steps[3:]], checkpoints, topics))
    shape = [
        (topic, [(type(e).__name__, e.run_id, e.step) for e in events])
        for topic, events in segments
    ]
    assert shape == [
        (topics.steps, [("StepEvent", "rec", 0), ("StepEvent", "rec", 1)]),
        (topics.checkpoints, [("CheckpointEvent", "rec", 2)]),
        (
            topics.steps,
            [("StepEvent", "rec", 2), ("StepEvent", "other", 0), ("StepEvent", "rec", 3)],
        ),
        (topics.checkpoints, [("CheckpointEvent", "rec", 4), ("CheckpointEvent", "rec", 2)]),
        (topics.steps, [("StepEvent", "rec", 4), ("StepEvent", "rec", 5)]),
        (topics.checkpoints, [("CheckpointEvent", "rec", 9)]),
    ]
