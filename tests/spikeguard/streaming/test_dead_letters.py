"""Every component sends malformed records on every topic it reads to the DLQ and goes on."""

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import COMPONENTS, build_stage
from spikeguard.metrics import Metrics
from spikeguard.streaming.worker import Worker
from spikeguard.schemas import (
    Ack,
    AckStatus,
    ActionKind,
    CheckpointEvent,
    DeadLetter,
    Decision,
    StepEvent,
    StepVerdicts,
    Topics,
    Verdict,
    RunEvent,
    decision_id,
    decode,
    encode,
)
from spikeguard.settings import load_settings

TOPICS = Topics("dlq-test.")

BAD = [
    (b"\x00\x01 not json", "MalformedMessage", "not JSON"),
    (b'{"schema_version": 99, "run_id": "r", "step": 1}', "UnknownSchemaVersion", "99"),
    (b'{"run_id": "r", "step": "seven"}', "MalformedMessage", "step"),
]


def good_event(topic: str, step: int):
    if topic == TOPICS.steps:
        return StepEvent(run_id="r", step=step, loss=2.0 - step * 0.001, grad_norm=1.0, lr=1e-3)
    if topic == TOPICS.verdicts:
        return Verdict(run_id="r", step=step, detector="rules", is_anomaly=False)
    if topic == TOPICS.step_verdicts:
        return StepVerdicts(
            run_id="r",
            step=step,
            verdicts=[Verdict(run_id="r", step=step, detector="statistical", is_anomaly=False)],
        )
    if topic == TOPICS.decisions:
        return Decision(decision_id=decision_id("r", step), run_id="r", step=step, is_anomaly=False)
    if topic == TOPICS.runs:
        return RunEvent(run_id="r", kind="start", step=step)
    if topic == TOPICS.checkpoints:
        return CheckpointEvent(run_id="r", step=step, checkpoint_id=f"c{step}", healthy=True)
    return Ack(
        run_id="r", action_id=f"a{step}", kind=ActionKind.CLIP, status=AckStatus.APPLIED, step=step
    )


@pytest.mark.parametrize("component", COMPONENTS)
def test_malformed_records_on_every_input_topic_reach_the_dlq(component):
    bus = EmbeddedBus(partitions=2)
    settings = load_settings({"topic_prefix": TOPICS.prefix}, env={})
    registry = CollectorRegistry()
    worker = Worker(
        bus, build_stage(component, settings, TOPICS), metrics=Metrics(registry), snapshots=False
    )
    producer = bus.producer()
    inputs = list(worker.stage.inputs())
    for topic in inputs:
        # A compacted topic (runs) keeps only the newest record of a key: one key each there.
        keys = (f"r{n}" if topic == TOPICS.runs else "r" for n in range(13))
        for step in range(5):
            producer.publish(topic, encode(good_event(topic, step)), key=next(keys))
        for value, _, _ in BAD:
            producer.publish(topic, value, key=next(keys))
        for step in range(5, 10):
            producer.publish(topic, encode(good_event(topic, step)), key=next(keys))
    while worker.run_once(timeout=0):
        pass

    letters = [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]
    assert len(letters) == len(BAD) * len(inputs)
    for topic in inputs:
        mine = [letter for letter in letters if letter.source_topic == topic]
        assert [letter.error for letter in mine] == [error for _, error, _ in BAD]
        for letter, (_, _, words) in zip(mine, BAD):
            assert words in letter.reason and letter.consumer == f"{TOPICS.prefix}{component}"
    consumed = sum(
        registry.get_sample_value(
            "spikeguard_records_consumed_total", {"component": component, "topic": topic}
        )
        or 0
        for topic in inputs
    )
    assert consumed == 13 * len(inputs)  # it went on past the bad records
    if component in ("statistical", "rules", "ml", "predictor"):
        verdicts = [decode(r.value, Verdict) for r in bus.read_all(TOPICS.verdicts)]
        assert sorted(v.step for v in verdicts) == list(range(10))
