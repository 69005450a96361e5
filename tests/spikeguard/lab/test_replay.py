"""Replaying a recorded run twice gives identical decisions and action ids."""

import pytest

from spikeguard.lab.backtest import replay_events
from spikeguard.lab.simulate import generate
from spikeguard.schemas import CheckpointEvent, Topics
from spikeguard.settings import load_settings


def recorded_run():
    run = generate("non_finite", 3000, seed=3, run_id="rec")
    checkpoints = [
        CheckpointEvent(
            run_id="rec", step=step, checkpoint_id=f"c{step}", healthy=True, time=float(step)
        )
        for step in range(0, 3000, 50)
    ]
    return run, checkpoints


@pytest.mark.heavy
def test_replaying_twice_gives_identical_decisions_and_action_ids():
    run, checkpoints = recorded_run()
    settings = load_settings(env={})
    first = replay_events(run.events, checkpoints, settings)
    second = replay_events(run.events, checkpoints, settings)
    topics = Topics()
    assert [d.model_dump_json() for d in first[topics.decisions]] == [
        d.model_dump_json() for d in second[topics.decisions]
    ]
    first_actions = [(a.action_id, a.kind, a.apply_at_step) for a in first[topics.actions]]
    assert first_actions == [(a.action_id, a.kind, a.apply_at_step) for a in second[topics.actions]]
    assert any(kind.value == "rollback" for _, kind, _ in first_actions)
    onsets = [e.step for e, label in zip(run.events, run.labels) if label.kind == "non_finite"]
    anomalous = {d.step for d in first[topics.decisions] if d.is_anomaly}
    assert set(onsets) <= anomalous  # every non-finite step is decided as anomalous
