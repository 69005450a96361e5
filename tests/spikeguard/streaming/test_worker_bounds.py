"""A flood of made-up run ids and one huge record cannot grow a worker without bound.

The finding: 50,000 unsigned verdicts, one per fake run, plus one 900 KB
verdict took fusion from 158 to 462 MiB, and it stayed. With a key, the
unsigned ones are refused before any state sees them; without one
(``--insecure``), a worker holds at most ``worker.max_runs`` runs and refuses
the rest, counted in ``spikeguard_runs_refused_total``; a record over
``worker.max_input_record_bytes`` is refused unparsed. Real fusion stage, real
Worker, real embedded bus, records published as bytes (as on Kafka).
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import build_stage
from spikeguard.metrics import Metrics
from spikeguard.schemas import DeadLetter, Topics, Verdict, decode, encode
from spikeguard.schemas.signing import sign
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

KEY = "fusion-key-0123456789abcdef"
TOPICS = Topics("bounds.")
FAKE_RUNS = 2_000
MAX_RUNS = 100


def fusion_worker(bus: EmbeddedBus, key: str | None) -> tuple[Worker, Metrics]:
    values = {"topic_prefix": TOPICS.prefix, **({"signing_key": key} if key else {})}
    metrics = Metrics(CollectorRegistry())
    stage = build_stage("fusion", load_settings(values, env={}), TOPICS)
    return Worker(bus, stage, metrics=metrics, snapshots=False, max_runs=MAX_RUNS), metrics


def verdict(run_id: str, step: int = 0, **fields) -> Verdict:
    return Verdict(run_id=run_id, step=step, detector="statistical", is_anomaly=False, **fields)


def drain(bus: EmbeddedBus, worker: Worker, values: list[bytes], keys: list[str]) -> None:
    producer = bus.producer()
    for value, key in zip(values, keys):
        producer.publish(TOPICS.verdicts, value, key=key)
    while worker.run_once(timeout=0):
        pass


def letters(bus: EmbeddedBus) -> list[DeadLetter]:
    return [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]


def test_with_a_key_a_flood_of_unsigned_verdicts_makes_no_state():
    bus = EmbeddedBus(partitions=1)
    worker, _ = fusion_worker(bus, KEY)
    flood = [verdict(f"fake-{i}") for i in range(FAKE_RUNS)]
    drain(bus, worker, [encode(v) for v in flood], [v.run_id for v in flood])
    assert worker.stage.runs == {} and worker.stage.clock.times == {}
    assert {d.error for d in letters(bus)} == {"RecordNotAuthenticated"}
    # A run whose verdicts the detectors signed is still held.
    drain(bus, worker, [encode(sign(verdict("real"), KEY))], ["real"])
    assert list(worker.stage.runs) == ["real"]


def test_without_a_key_a_flood_of_run_ids_is_bounded_by_max_runs_and_counted():
    bus = EmbeddedBus(partitions=1)
    worker, metrics = fusion_worker(bus, None)
    flood = [verdict(f"fake-{i}") for i in range(FAKE_RUNS)]
    drain(bus, worker, [encode(v) for v in flood], [v.run_id for v in flood])
    assert len(worker.stage.runs) == MAX_RUNS
    assert len(worker.stage.clock.times) <= MAX_RUNS
    refused = FAKE_RUNS - MAX_RUNS
    assert metrics.runs_refused.labels("fusion")._value.get() == refused
    dead = letters(bus)
    assert len(dead) == refused and {d.error for d in dead} == {"TooManyRuns"}
    assert "worker.max_runs=100" in dead[0].reason
    # A run already held goes on.
    drain(bus, worker, [encode(verdict("fake-0", step=1))], ["fake-0"])
    assert len(letters(bus)) == refused


@pytest.mark.parametrize("key", [KEY, None], ids=["signed", "insecure"])
def test_a_huge_record_is_refused_unparsed(key):
    bus = EmbeddedBus(partitions=1)
    worker, _ = fusion_worker(bus, key)
    huge = verdict("real", message="x" * 900_000, signals={f"s{i}": float(i) for i in range(100)})
    huge = sign(huge, key) if key else huge
    drain(bus, worker, [encode(huge)], ["real"])
    (letter,) = letters(bus)
    assert letter.error == "MessageTooLarge" and "exceeds the 65536-byte limit" in letter.reason
    assert worker.stage.runs == {}
