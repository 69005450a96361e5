"""A flood of unsigned records costs a worker what it costs to drop them.

With a key, a record that carries no signature is refused before it is
parsed; the log says the first few in full and then one line per interval
with a count; the DLQ gets a bounded number of them per interval; the
dead-letters metric counts every one. A signed run's steps in the same
partition are judged as without the flood.
"""

from __future__ import annotations

import logging
import math

from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import build_stage
from spikeguard.metrics import Metrics
from spikeguard.schemas import DeadLetter, StepEvent, Topics, Verdict, decode, encode
from spikeguard.schemas.signing import sign
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

KEY = "flood-test-key-0123456789"
TOPICS = Topics("flood-test.")
FLOOD = 3000


def step(n: int, loss: float = 1.0) -> StepEvent:
    return StepEvent(run_id="victim", step=n, time=1000.0 + n, loss=loss, grad_norm=1.0)


def test_a_flood_of_unsigned_steps_is_dropped_unparsed_logged_at_a_bounded_rate_and_counted(
    caplog,
):
    bus = EmbeddedBus(partitions=1)
    metrics = Metrics(CollectorRegistry())
    settings = load_settings({"topic_prefix": TOPICS.prefix, "signing_key": KEY}, env={})
    worker = Worker(
        bus,
        build_stage("rules", settings, TOPICS),
        snapshots=False,
        metrics=metrics,
        unsigned_letters_per_interval=100,
    )
    producer = bus.producer()
    genuine = [sign(step(n), KEY) for n in range(40)] + [sign(step(40, math.nan), KEY)]
    for n, event in enumerate(genuine):  # the flood in the run's own partition, among its steps
        producer.publish(TOPICS.steps, encode(event), key="victim")
        for k in range(FLOOD // len(genuine) + 1):
            producer.publish(TOPICS.steps, encode(step(10_000 + n * 100 + k)), key="victim")
    with caplog.at_level(logging.WARNING, logger="spikeguard.streaming.worker"):
        while worker.run_once(timeout=0):
            pass
        worker._refusals.interval_s = 0.0  # the interval is over: its summary line goes out
        worker.run_once(timeout=0)

    flooded = (FLOOD // len(genuine) + 1) * len(genuine)
    verdicts = [decode(r.value, Verdict) for r in bus.read_all(TOPICS.verdicts)]
    assert [v.step for v in verdicts] == list(range(41))  # every genuine step, judged
    assert verdicts[-1].is_anomaly  # the non-finite one among them
    refused = caplog.records
    assert len(refused) <= 10, [r.getMessage()[:120] for r in refused]  # not one per record
    assert "no signature" in refused[0].getMessage()
    assert f"{flooded - 5} more records refused" in refused[-1].getMessage()
    letters = [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]
    assert len(letters) == 100 and {d.error for d in letters} == {"StepNotAuthenticated"}
    assert "unsigned step event" in letters[0].reason
    counted = metrics.registry.get_sample_value(
        "spikeguard_dead_letters_total", {"component": "rules", "error": "StepNotAuthenticated"}
    )
    assert counted == flooded
