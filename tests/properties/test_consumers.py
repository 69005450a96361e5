"""A worker fed arbitrary records on the embedded bus never dies, and every bad record lands in the DLQ.

Each component (the four detectors, fusion, the actuator) runs in a real
Worker on the real embedded bus; hypothesis mixes hostile records (arbitrary
bytes, arbitrary JSON, near-valid events, oversized ones) with valid events.
Every record is accounted for: consumed, and either processed or in the DLQ
with the reason; whatever does not decode is in the DLQ with the decoder's
own error.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import COMPONENTS, DETECTOR_NAMES, build_stage
from spikeguard.errors import SchemaError
from spikeguard.streaming.config import DEFAULT_MAX_INPUT_RECORD_BYTES
from spikeguard.metrics import Metrics
from spikeguard.schemas import DeadLetter, Topics, Verdict, decode, encode
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

from .strategies import VALID, hostile

TOPICS = Topics("prop.")


def _records(model: type) -> st.SearchStrategy[list[tuple[bytes, str]]]:
    valid = encode(model.model_validate(VALID[model]))
    one = st.one_of(st.just(valid), hostile(model))
    keys = st.one_of(st.just("r"), st.text(min_size=1, max_size=5))
    return st.lists(st.tuples(one, keys), min_size=1, max_size=12)


@pytest.mark.parametrize("component", COMPONENTS)
@settings(
    max_examples=25,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
@pytest.mark.heavy
def test_a_worker_fed_anything_stays_up_and_dead_letters_every_bad_record(component, data):
    bus = EmbeddedBus(partitions=2)
    registry = CollectorRegistry()
    worker = Worker(
        bus,
        build_stage(component, load_settings({"topic_prefix": TOPICS.prefix}, env={}), TOPICS),
        metrics=Metrics(registry),
        snapshots=False,
    )
    inputs = worker.stage.inputs()
    producer = bus.producer()
    sent = []
    for topic, model in inputs.items():
        for n, (value, key) in enumerate(data.draw(_records(model), label=topic)):
            if topic == TOPICS.runs:  # compacted: a key keeps only its newest record
                key = f"{key}-{n}"
            producer.publish(topic, value, key=key)
            sent.append((topic, model, value))
    for _ in range(3):  # the worker goes on after a batch full of hostile records
        while worker.run_once(timeout=0):
            pass
        worker.drain()

    consumed = sum(
        registry.get_sample_value(
            "spikeguard_records_consumed_total", {"component": component, "topic": t}
        )
        or 0
        for t in inputs
    )
    assert consumed == len(sent)  # nothing lost, nothing skipped
    letters = [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]
    dead = {(d.source_topic, d.partition, d.offset): d for d in letters}
    assert len(dead) == len(letters)  # one letter per bad record
    records = {(r.topic, r.partition, r.offset): r for t in inputs for r in bus.read_all(t)}
    for where, record in records.items():
        try:
            # A worker's input limit is below the decoder's own: the same check, its limit.
            decode(record.value, inputs[record.topic], max_bytes=DEFAULT_MAX_INPUT_RECORD_BYTES)
        except SchemaError as exc:
            assert dead[where].error == type(exc).__name__, (record.value, dead.get(where))
            assert dead[where].reason == str(exc)
    if component in DETECTOR_NAMES:  # a verdict for every step not in the DLQ
        verdicts = [decode(r.value, Verdict) for r in bus.read_all(TOPICS.verdicts)]
        steps = [s for s in sent if s[0] == TOPICS.steps]
        assert len(verdicts) == len(steps) - sum(d.source_topic == TOPICS.steps for d in letters)
