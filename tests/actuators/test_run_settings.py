"""The actuator applies each run's own policy from its RunEvent, on a real worker and bus.

The stage's own policy here is PolicyConfig's defaults (roll back at least 100
steps before an onset); the run names the ``small`` preset (30 steps). A
checkpoint at step 20 and a critical anomaly at step 60 tell them apart: only
the run's policy finds a rollback target.
"""

from __future__ import annotations

import math

import pytest

from spikeguard.bus import EmbeddedBus
from spikeguard.components import build_stage
from spikeguard.schemas import (
    Action,
    ActionKind,
    AnomalyType,
    CheckpointEvent,
    DeadLetter,
    Decision,
    Evidence,
    RunEvent,
    Topics,
    decision_id,
    decode,
    encode,
)
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

TOPICS = Topics("runpolicy-test.")
RUN = "r1"


def make_worker(bus: EmbeddedBus, **settings) -> Worker:
    # The decisions below are critical non-finite ones, recovered from at once by a policy
    # whose trainer does not skip them itself (the Guard does: then one needs nothing).
    settings = {"policy.non_finite_skipped_by_trainer": False, **settings}
    stage = build_stage(
        "actuator", load_settings({"topic_prefix": TOPICS.prefix, **settings}, env={}), TOPICS
    )
    return Worker(bus, stage, snapshots=False)


def publish(bus: EmbeddedBus, worker: Worker, *events) -> None:
    producer = bus.producer()
    for topic, event in events:
        producer.publish(topic, encode(event), key=event.run_id)
    while worker.run_once(timeout=0):
        pass


def start(run_id: str = RUN, **fields) -> tuple[str, RunEvent]:
    values = dict(
        run_id=run_id,
        kind="start",
        preset="small",
        checkpoint_every=20,
        keep_checkpoints=4,
        detection_delay_steps=10,
        policy={"non_finite_skipped_by_trainer": False},
    )
    return TOPICS.runs, RunEvent(**{**values, **fields})


def end(step: int, run_id: str = RUN, epoch: int = 0) -> tuple[str, RunEvent]:
    return TOPICS.runs, RunEvent(
        run_id=run_id, kind="end", preset="small", step=step, epoch=epoch, finished=True
    )


def checkpoint(step: int, run_id: str = RUN) -> tuple[str, CheckpointEvent]:
    return TOPICS.checkpoints, CheckpointEvent(
        run_id=run_id, step=step, checkpoint_id=f"c{step}", healthy=True
    )


def decision(step: int, run_id: str = RUN, anomaly: bool = False) -> tuple[str, Decision]:
    fields = (
        dict(
            is_anomaly=True,
            critical=True,
            type=AnomalyType.NON_FINITE,
            confidence=1.0,
            incident_id=f"i{step}",
            incident_onset_step=step,
        )
        if anomaly
        else dict(is_anomaly=False)
    )
    loss = math.nan if anomaly else 1.0
    return TOPICS.decisions, Decision(
        decision_id=decision_id(run_id, step),
        run_id=run_id,
        step=step,
        evidence=Evidence(step=step, loss=loss, grad_norm=1.0),
        **fields,
    )


def actions(bus: EmbeddedBus, run_id: str = RUN) -> list[Action]:
    found = [decode(r.value, Action) for r in bus.read_all(TOPICS.actions)]
    return [a for a in found if a.run_id == run_id]


def healthy_run(upto: int, run_id: str = RUN) -> list:
    return [decision(s, run_id) for s in range(21, upto)]


def test_the_runs_preset_decides_the_rollback_the_stage_default_would_not():
    bus = EmbeddedBus(partitions=2)
    worker = make_worker(bus)
    # "plain" names no policy: the stage's own, which finds no checkpoint 100 steps back.
    publish(
        bus, worker, start(), start("plain", preset=None), checkpoint(20), checkpoint(20, "plain")
    )
    publish(
        bus,
        worker,
        *healthy_run(60),
        decision(60, anomaly=True),
        *healthy_run(60, "plain"),
        decision(60, "plain", anomaly=True),
    )
    mine = actions(bus)
    assert ActionKind.ROLLBACK in {a.kind for a in mine}, [a.reason for a in mine]
    rollback = next(a for a in mine if a.kind is ActionKind.ROLLBACK)
    assert rollback.params.target_step == 20 and ">= 30 steps before onset" in rollback.reason
    plain = actions(bus, "plain")
    assert ActionKind.ROLLBACK not in {a.kind for a in plain}
    assert any("no healthy checkpoint at least 100 steps before onset" in a.reason for a in plain)


def test_overrides_without_a_preset_apply_over_the_stages_own_policy():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus, **{"policy.skip_extra_batches": 7})
    publish(
        bus,
        worker,
        start(preset=None, policy={"rollback_min_steps_before_onset": 40}),
        checkpoint(20),
    )
    publish(bus, worker, *healthy_run(60), decision(60, anomaly=True))
    skip = next(a for a in actions(bus) if a.kind is ActionKind.SKIP_BATCHES)
    assert skip.params.extra == 7  # the stage's own setting, kept
    assert any(a.kind is ActionKind.ROLLBACK for a in actions(bus))  # the run's 40, not 100


def test_a_start_that_arrives_after_the_first_decisions_applies_from_then_on_with_the_state_kept():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus)
    publish(bus, worker, checkpoint(20))
    publish(bus, worker, *healthy_run(40))  # judged under the stage's policy: nothing to do
    policy_before = worker.stage.runs[RUN]
    assert (
        policy_before.config.rollback_min_steps_before_onset == 100
        and policy_before.high_water == 39
    )
    publish(bus, worker, start(), decision(39))  # the start overtaken; then a redelivered decision
    policy = worker.stage.runs[RUN]
    assert policy.config.rollback_min_steps_before_onset == 30
    assert policy.high_water == 39 and policy.counts["duplicate"] == 1  # its state came along
    assert [c.step for c in policy.recovery.book.healthy] == [20]
    publish(bus, worker, *[decision(s) for s in range(40, 60)], decision(60, anomaly=True))
    assert ActionKind.ROLLBACK in {a.kind for a in actions(bus)}


@pytest.mark.parametrize(
    "bad, words",
    [
        (dict(preset="huge"), "unknown preset 'huge'"),
        (dict(policy={"rollback_min_steps_befor": 5}), "rollback_min_steps_befor"),
        (dict(policy={"lr_decrease_factor_spike": 3.0}), "lr_decrease_factor_spike"),
        (dict(policy={"spike_types": ["non_finite"]}), "always critical"),
    ],
)
def test_a_bad_preset_or_override_goes_to_the_dlq_and_the_run_keeps_the_defaults(bad, words):
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus)
    publish(bus, worker, start(**bad), checkpoint(20))
    publish(bus, worker, *healthy_run(60), decision(60, anomaly=True))
    letters = [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]
    assert len(letters) == 1 and letters[0].source_topic == TOPICS.runs
    assert letters[0].error == "RunSettingsRejected" and words in letters[0].reason
    assert "keeps this stage's defaults" in letters[0].reason
    # The stage went on, with its own policy for the run: no target 100 steps back.
    assert worker.stage.runs[RUN].config.rollback_min_steps_before_onset == 100
    assert any("no healthy checkpoint at least 100" in a.reason for a in actions(bus))


def test_a_cadence_that_cannot_serve_the_applied_policy_is_answered_with_one_alert():
    bus = EmbeddedBus(partitions=1)
    # No policy named: the Guard could check only PolicyConfig's defaults; here the pipeline's
    # own distance is 300 (a setting of this actuator), which 3 x 50 cannot reach.
    worker = make_worker(bus, **{"policy.rollback_min_steps_before_onset": 300})
    publish(
        bus,
        worker,
        start(preset=None, checkpoint_every=50, keep_checkpoints=3, detection_delay_steps=25),
    )
    publish(
        bus,
        worker,
        start(preset=None, checkpoint_every=50, keep_checkpoints=3, detection_delay_steps=25),
    )
    alerts = actions(bus)
    assert len({a.action_id for a in alerts}) == 1 and alerts[0].kind is ActionKind.ALERT
    assert alerts[0].params.severity == "warning"
    assert "rollback_min_steps_before_onset=300" in alerts[0].params.message
    assert "raise keep_checkpoints to 8" in alerts[0].params.message
    publish(bus, worker, start("fits", preset="small"))
    assert actions(bus, "fits") == []


def test_an_end_drops_the_run_once_its_last_step_is_handled_and_a_restart_keeps_the_runs_policy():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus)
    publish(bus, worker, start())
    publish(bus, worker, *healthy_run(30), end(35))  # the end overtook steps 30..34
    stage = worker.stage
    assert RUN in stage.runs  # waiting for the last step
    saved = stage.snapshot([RUN])
    restarted = make_worker(EmbeddedBus(partitions=1)).stage
    restarted.restore(saved)
    assert restarted.runs[RUN].config.rollback_min_steps_before_onset == 30  # the run's, not 100
    assert restarted.ending.mark(RUN) == [0, 35]
    publish(bus, worker, *[decision(s) for s in range(30, 35)])
    assert RUN not in stage.runs and stage.snapshot([RUN]) == {}


def test_an_end_that_waits_too_long_ends_the_run_after_the_grace():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus)
    publish(bus, worker, start())
    publish(bus, worker, *healthy_run(30), end(500))
    stage = worker.stage
    assert RUN in stage.runs
    stage.tick(stage.ending.pending[RUN][2] + stage.ending.grace_seconds)
    assert RUN not in stage.runs
