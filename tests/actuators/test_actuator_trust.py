"""Nobody without the key can disarm a run at the actuator, and no record moves a run's clock.

The real actuator stage (built from settings, as its worker builds it), a real
Worker, the real embedded bus; records are published as bytes, as on Kafka,
so the worker decodes and checks each itself. The attacker can write the
decisions, checkpoints and acks topics but holds no key.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import build_stage
from spikeguard.metrics import Metrics
from spikeguard.schemas import (
    MAX_COUNTER,
    Ack,
    AckStatus,
    Action,
    ActionKind,
    AnomalyType,
    CheckpointEvent,
    DeadLetter,
    Decision,
    Evidence,
    Topics,
    decision_id,
    decode,
    encode,
)
from spikeguard.schemas.signing import sign
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

KEY = "pipeline-key-0123456789abcdef"
TOPICS = Topics("acttrust.")
RUN = "victim"


def actuator(bus: EmbeddedBus, key: str | None) -> Worker:
    values = {"topic_prefix": TOPICS.prefix, **({"signing_key": key} if key else {})}
    stage = build_stage("actuator", load_settings(values, env={}), TOPICS)
    return Worker(bus, stage, metrics=Metrics(CollectorRegistry()), snapshots=False)


def publish(bus: EmbeddedBus, worker: Worker, *events) -> None:
    producer = bus.producer()
    for topic, event in events:
        producer.publish(topic, encode(event), key=event.run_id)
    while worker.run_once(timeout=0):
        pass


def decision(step: int, key: str | None, anomaly: bool = False) -> tuple[str, Decision]:
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
    made = Decision(
        decision_id=decision_id(RUN, step),
        run_id=RUN,
        step=step,
        evidence=Evidence(step=step, loss=math.nan if anomaly else 1.0, grad_norm=1.0),
        **fields,
    )
    return TOPICS.decisions, made if key is None else sign(made, key)


def checkpoint(step: int, key: str | None, checkpoint_id: str) -> tuple[str, CheckpointEvent]:
    made = CheckpointEvent(run_id=RUN, step=step, checkpoint_id=checkpoint_id, healthy=True)
    return TOPICS.checkpoints, made if key is None else sign(made, key)


def the_real_run(bus: EmbeddedBus, worker: Worker, key: str | None, *forged) -> None:
    """A checkpoint, a healthy stretch (and ``forged``), then a non-finite step that recurs: a rollback is
    due (one non-finite step alone the Guard has already skipped).

    The checkpoint is read first: the actuator's topics are not ordered among themselves.
    """
    publish(bus, worker, checkpoint(20, key, "c20"))
    publish(bus, worker, *[decision(s, key) for s in range(21, 150)], *forged)
    publish(bus, worker, decision(150, key, anomaly=True), decision(151, key, anomaly=True))


def rollbacks(bus: EmbeddedBus) -> list[Action]:
    return [
        a
        for a in (decode(r.value, Action) for r in bus.read_all(TOPICS.actions))
        if a.kind is ActionKind.ROLLBACK
    ]


def letters(bus: EmbeddedBus) -> list[DeadLetter]:
    return [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]


def test_one_forged_far_future_decision_no_longer_disarms_the_run():
    """The critical finding: one unsigned healthy decision for step 2**53-1 made every real one late."""
    bus = EmbeddedBus(partitions=1)
    worker = actuator(bus, KEY)
    publish(bus, worker, decision(10, KEY), decision(MAX_COUNTER, None))
    the_real_run(bus, worker, KEY)

    (rollback,) = rollbacks(bus)
    assert rollback.params.target_step == 20 and rollback.signature
    assert worker.stage.run(RUN).high_water == 151
    (letter,) = letters(bus)
    assert letter.error == "RecordNotAuthenticated" and letter.source_topic == TOPICS.decisions
    assert f"run {RUN}: no signature (an unsigned decision" in letter.reason  # refused unparsed


@pytest.mark.parametrize(
    "forged_key", [None, "another-key-0123456789abcdef"], ids=["unsigned", "other-key"]
)
def test_forged_checkpoints_and_acks_are_refused_and_choose_nothing(forged_key):
    """Checkpoint events choose the rollback target, acks say whether a rollback counted: the trainer's own only."""
    bus = EmbeddedBus(partitions=1)
    worker = actuator(bus, KEY)
    # A newer healthy checkpoint the trainer never wrote would become the rollback target.
    the_real_run(bus, worker, KEY, checkpoint(40, forged_key, "forged-c40"))
    (rollback,) = rollbacks(bus)
    assert rollback.params.checkpoint_id == "c20"
    # An ack saying the rollback failed would make the policy give up its target.
    forged_ack = Ack(
        run_id=RUN,
        action_id=rollback.action_id,
        kind=ActionKind.ROLLBACK,
        status=AckStatus.FAILED,
        step=151,
        result="forged",
    )
    publish(
        bus,
        worker,
        (TOPICS.acks, forged_ack if forged_key is None else sign(forged_ack, forged_key)),
    )
    policy = worker.stage.run(RUN)
    assert [c.checkpoint_id for c in policy.recovery.book.healthy] == ["c20"]
    assert rollback.action_id not in policy.acks
    refused = letters(bus)
    assert [(d.source_topic, d.error) for d in refused] == [
        (TOPICS.checkpoints, "RecordNotAuthenticated"),
        (TOPICS.acks, "RecordNotAuthenticated"),
    ]


def test_without_a_key_a_far_future_decision_is_refused_by_the_run_clock_not_adopted():
    """--insecure: no signatures to check, but one record still cannot move the run's clock."""
    bus = EmbeddedBus(partitions=1)
    worker = actuator(bus, None)
    publish(bus, worker, decision(10, None))
    publish(bus, worker, decision(MAX_COUNTER, None), checkpoint(MAX_COUNTER - 1, None, "far"))
    the_real_run(bus, worker, None)

    (rollback,) = rollbacks(bus)
    assert rollback.params.target_step == 20
    refused = letters(bus)
    assert [d.error for d in refused] == ["RecordBeyondRunClock"] * 2
    assert "more than 1000000 steps past step 10" in refused[0].reason


def test_the_worker_logs_one_info_line_per_incident_it_handles(caplog):
    """A non-finite step the Guard skipped (an alert), its recurrence (a rollback plan), and
    more decisions of that incident: one line per incident, naming its plan, not one per step."""
    import logging

    bus = EmbeddedBus(partitions=1)
    worker = actuator(bus, KEY)
    with caplog.at_level(logging.INFO, logger="spikeguard.actuators.actuator_stage"):
        the_real_run(bus, worker, KEY)
        later = decision(152, KEY, anomaly=True)[1].model_copy(
            update={"incident_id": "i151", "incident_onset_step": 151, "signature": None}
        )
        publish(bus, worker, (TOPICS.decisions, sign(later, KEY)))
    lines = [
        r.getMessage() for r in caplog.records if r.name == "spikeguard.actuators.actuator_stage"
    ]
    assert [line.split(" (")[0] for line in lines] == [
        f"actuator: run {RUN} incident i150",
        f"actuator: run {RUN} incident i151",
    ]
    assert "): alert at step 151" in lines[0]
    assert "): rollback+skip_batches+scale_lr+clip at step 152" in lines[1]
    assert len(rollbacks(bus)) == 1
