"""The run carries its own policy: preset, overrides, checked settings, runs topic."""

from __future__ import annotations

import logging

import pytest

from producers_helpers import Tiny, train
from spikeguard.actuators.config import PolicyConfig
from spikeguard.errors import ConfigError
from spikeguard.producers import Guard, GuardConfig
from spikeguard.producers.run_plan import make_plan
from spikeguard.schemas import RunEvent, decode


def _runs(bus, topics) -> list[RunEvent]:
    return [decode(r.value, RunEvent) for r in bus.read_all(topics.runs)]


@pytest.mark.heavy
def test_the_defaults_keep_a_rollback_target_far_enough_before_an_onset(tmp_path, caplog):
    """Checkpoint every 50, keep 3 and roll back >= 100 before onset left no target; now they fit."""
    with caplog.at_level(logging.WARNING):
        # The policy's default distance, named so that an inconsistency would be refused.
        plan = make_plan(GuardConfig(), policy={"rollback_min_steps_before_onset": 100})
    assert not caplog.records
    tiny = Tiny(n=4096)
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        run_id="d",
        bus=None,
        connect=False,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "c"), resume=False),
    )
    train(guard, tiny, 301)
    guard.close()
    onset = 301 - guard.config.detection_delay_steps  # the rollback is decided now
    limit = onset - PolicyConfig().rollback_min_steps_before_onset
    kept = [c.step for c in guard.store.list() if c.healthy]
    assert any(step <= limit for step in kept), (kept, limit)
    assert plan.config.keep_checkpoints == 4 and plan.config.checkpoint_every == 50


def test_an_inconsistent_combination_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ConfigError) as refused:
        make_plan(GuardConfig(checkpoint_every=50, keep_checkpoints=3), preset="medium")
    text = str(refused.value)
    assert "keep_checkpoints=3" in text and "checkpoint_every=50" in text
    assert "rollback_min_steps_before_onset=100" in text and "detection_delay_steps=25" in text
    assert "raise keep_checkpoints to 4" in text
    tiny = Tiny()
    with pytest.raises(ConfigError, match="rollback_min_steps_before_onset=300"):
        Guard(
            tiny.model,
            tiny.optimizer,
            run_id="x",
            bus=None,
            connect=False,
            policy={"rollback_min_steps_before_onset": 300},
            config=GuardConfig(checkpoint_dir=str(tmp_path), resume=False),
        )


def test_without_a_named_policy_the_check_warns_instead(caplog):
    with caplog.at_level(logging.WARNING, logger="spikeguard.producers.guard"):
        make_plan(GuardConfig(checkpoint_every=10))
    assert len(caplog.records) == 1 and "keep_checkpoints=4 x checkpoint_every=10" in caplog.text


def test_bad_presets_and_overrides_are_refused():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        make_plan(GuardConfig(), preset="huge")
    with pytest.raises(ConfigError, match="rollback_min_steps_befor"):
        make_plan(GuardConfig(), policy={"rollback_min_steps_befor": 5})


def test_a_preset_sets_the_checkpoint_interval_unless_the_user_did(monkeypatch):
    assert make_plan(GuardConfig(), preset="large").config.checkpoint_every == 50
    assert make_plan(GuardConfig(), preset="small").config.checkpoint_every == 200
    assert (
        make_plan(GuardConfig(checkpoint_every=100), preset="small").config.checkpoint_every == 100
    )
    monkeypatch.setenv("SPIKEGUARD_PRESET", "small")
    assert make_plan(GuardConfig()).preset == "small"
    assert (
        make_plan(GuardConfig(preset="large")).preset == "large"
    )  # the config over the environment
    assert (
        make_plan(GuardConfig(preset="large"), preset="medium").preset == "medium"
    )  # the argument first


def test_the_guard_publishes_its_run_on_the_compacted_runs_topic(bus, topics, tmp_path):
    tiny = Tiny()
    overrides = {"spike_patience_steps": 4, "rollback_min_steps_before_onset": 60}
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        run_id="r1",
        bus=bus,
        preset="large",
        policy=overrides,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "c"), resume=False),
    )
    train(guard, tiny, 12)
    started = _runs(bus, topics)
    assert [e.kind for e in started] == ["start"]
    start = started[0]
    assert (start.preset, start.checkpoint_every, start.keep_checkpoints, start.planned_steps) == (
        "large",
        50,
        4,
        12,
    )
    assert start.policy == overrides
    # What fusion and the actuator need: the run's policy, as PolicyConfig takes it.
    from spikeguard.actuators.presets import get_preset

    policy = get_preset(start.preset).policy_config(**start.policy)
    assert policy.spike_patience_steps == 4 and policy.rollback_min_steps_before_onset == 60
    guard.close()
    end = _runs(bus, topics)  # compacted: the end replaces the start, and carries the same settings
    assert [e.kind for e in end] == ["end"]
    assert (
        end[0].finished
        and end[0].step == 12
        and end[0].policy == overrides
        and end[0].preset == "large"
    )


def test_a_checkpoint_taken_after_an_incidents_onset_is_never_healthy(bus, topics, tmp_path):
    """The pipeline's answer comes detection_delay_steps after the onset: what was saved since is
    unhealthy, and rotation keeps the last checkpoint from before the incident."""
    from producers_helpers import action, make_guard, send
    from spikeguard.schemas import ActionKind, CheckpointEvent

    tiny = Tiny()
    guard = make_guard(
        tiny, bus, tmp_path, checkpoint_every=5, keep_checkpoints=3, detection_delay_steps=8
    )
    guard.checkpoints.judged = None  # (rotation alone: no pulse tracking, test_late_decisions.py)
    train(guard, tiny, 22)
    assert all(c.healthy for c in guard.store.list())  # nothing looked wrong to the trainer itself
    found = action(ActionKind.SCALE_LR, at=22, factor=0.5).model_copy(update={"incident_id": "i-1"})
    send(bus, found, guard=guard)
    train(guard, tiny, 31)
    guard.close()
    kept = [(c.step, c.healthy) for c in guard.store.list()]
    # 15 and 20 came after the earliest possible onset (22 - 8 = 14), so were demoted; 25 and 30
    # came during the incident; the newest healthy kept is from before the onset.
    assert kept == [(30, False), (25, False), (20, False), (10, True)]
    events = [decode(r.value, CheckpointEvent) for r in bus.read_all(topics.checkpoints)]
    demoted = [(e.step, e.healthy) for e in events if not e.deleted and e.step in (15, 20)]
    assert demoted[:2] == [(15, True), (20, True)] and sorted(demoted[2:]) == [
        (15, False),
        (20, False),
    ]


def test_an_outlier_the_trainer_skipped_itself_makes_the_next_checkpoint_unhealthy(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard_local(tiny, bus, tmp_path)

    def spike(g, data, batch):
        if g.step_count == 44:
            batch[1][:] = 1e3  # a wildly wrong target: an isolated outlier loss

    train(guard, tiny, 51, on_step=spike)
    guard.close()
    assert guard.counters["outlier_skips"] == 1
    health = {c.step: c.healthy for c in guard.store.list()}
    assert health[45] is False and health[40] is True


def make_guard_local(tiny, bus, tmp_path):
    from producers_helpers import make_guard

    return make_guard(
        tiny, bus, tmp_path, checkpoint_every=5, keep_checkpoints=4, incident_window=3
    )


def test_the_preset_through_settings_environment_and_set_flag():
    from spikeguard.settings import load_settings

    from_env = load_settings(env={"SPIKEGUARD_GUARD__PRESET": "large"}).guard
    assert (
        make_plan(from_env).preset == "large" and make_plan(from_env).config.checkpoint_every == 50
    )
    from_flag = load_settings(
        {"guard.preset": "small", "guard.policy": {"min_lr_factor": 0.2}}, env={}
    ).guard
    plan = make_plan(from_flag)
    assert plan.preset == "small" and plan.policy == {"min_lr_factor": 0.2}
