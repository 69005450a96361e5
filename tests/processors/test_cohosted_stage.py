"""`spikeguard worker detectors`: the four detectors behind one consumer judge as their four workers do.

Real detectors, real Workers, the real embedded bus; step records are
published as bytes (as on Kafka), so each consumer decodes them itself.
"""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import DETECTOR_NAMES, build_stage
from spikeguard.lab.simulate import generate
from spikeguard.metrics import Metrics
from spikeguard.processors.cohosted_stage import CoHostedDetectors
from spikeguard.schemas import (
    DeadLetter,
    StepEvent,
    StepVerdicts,
    Topics,
    Verdict,
    decode,
    encode,
    sign_step,
)
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

KEY = "cohost-key-0123456789abcdef"
TOPICS = Topics("cohost.")
SETTINGS = load_settings({"topic_prefix": TOPICS.prefix, "signing_key": KEY}, env={})


def steps() -> list[StepEvent]:
    """Two interleaved runs with spikes, signed as their trainers sign them."""
    runs = [generate("sudden_spike", 400, seed, run_id=f"run-{seed}").events for seed in (1, 2)]
    return [sign_step(e, KEY) for pair in zip(*runs) for e in pair]


def publish(bus: EmbeddedBus, events: list[StepEvent]) -> None:
    producer = bus.producer()
    for event in events:
        producer.publish(
            TOPICS.steps, encode(event), key=event.run_id
        )  # bytes: decoded per consumer


def cohosted_worker(
    bus: EmbeddedBus, registry: CollectorRegistry | None = None, **kwargs
) -> Worker:
    stage = CoHostedDetectors([build_stage(name, SETTINGS, TOPICS) for name in DETECTOR_NAMES])
    return Worker(bus, stage, metrics=Metrics(registry or CollectorRegistry()), **kwargs)


def drain(workers: list[Worker]) -> None:
    while sum(w.run_once(timeout=0) for w in workers):
        pass


def verdicts(bus: EmbeddedBus) -> dict[tuple[str, str, int, int], str]:
    """(detector, run, epoch, step) -> the verdict's whole JSON (at-least-once: duplicates agree).

    One Verdict per record on ``verdicts`` (independent workers), a step's verdicts in one
    StepVerdicts record on ``step-verdicts`` (co-hosted).
    """
    found: dict[tuple[str, str, int, int], str] = {}
    each = [decode(r.value, Verdict) for r in bus.read_all(TOPICS.verdicts)]
    packed = [
        v
        for r in bus.read_all(TOPICS.step_verdicts)
        for v in decode(r.value, StepVerdicts).verdicts
    ]
    for v in each + packed:
        v = v.model_copy(update={"signature": None})  # signed one by one, or as a record
        text = json.dumps(v.model_dump(mode="json"), sort_keys=True)
        key = (v.detector, v.run_id, v.epoch, v.step)
        assert found.setdefault(key, text) == text, key
    return found


def test_cohosted_detectors_publish_what_four_independent_workers_publish():
    events = steps()
    apart = EmbeddedBus(partitions=2)
    publish(apart, events)
    drain(
        [
            Worker(apart, build_stage(name, SETTINGS, TOPICS), snapshots=False)
            for name in DETECTOR_NAMES
        ]
    )
    together = EmbeddedBus(partitions=2)
    publish(together, events)
    worker = cohosted_worker(together, snapshots=False)
    assert worker.group == f"{TOPICS.prefix}detectors"
    drain([worker])

    expected, got = verdicts(apart), verdicts(together)
    assert got == expected
    assert {d for d, *_ in got} == set(DETECTOR_NAMES)
    assert len(got) == len(DETECTOR_NAMES) * len(events)
    assert any(json.loads(text)["is_anomaly"] for text in got.values())  # the spikes were judged


def test_a_forged_step_goes_to_the_dlq_once_and_no_detector_judges_it():
    events = steps()[:60]
    forged = events[40].model_copy(update={"loss": 1e6})  # signature of the genuine values
    bus = EmbeddedBus(partitions=1)
    publish(bus, events[:40] + [forged] + events[41:])
    registry = CollectorRegistry()
    drain([cohosted_worker(bus, registry, snapshots=False)])
    letters = [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]
    assert [letter.error for letter in letters] == ["StepNotAuthenticated"]
    judged = {(run, step) for _, run, _, step in verdicts(bus)}
    assert (forged.run_id, forged.step) not in judged
    assert len(judged) == len(events) - 1
    # Consumed once for the four of them: the input counter counts each record once.
    assert registry.get_sample_value(
        "spikeguard_records_consumed_total", {"component": "detectors", "topic": TOPICS.steps}
    ) == len(events)


@pytest.mark.heavy
def test_a_killed_cohosted_worker_resumes_with_the_verdicts_of_an_uninterrupted_one():
    events = steps()
    reference = EmbeddedBus(partitions=2)
    publish(reference, events)
    drain([cohosted_worker(reference, max_records=50)])
    expected = verdicts(reference)

    bus = EmbeddedBus(partitions=2)
    publish(bus, events)
    first = cohosted_worker(bus, max_records=50, snapshot_interval_s=0)
    for _ in range(4):
        first.run_once(timeout=0)
    first.snapshot_interval_s = 3600
    first.run_once(timeout=0)  # processed, never saved nor committed: redone after the restart
    first._consumer.close()  # killed: no final snapshot, no commit

    second = cohosted_worker(bus, max_records=50)
    drain([second])
    got = verdicts(bus)  # a redone step may appear twice, always with the same content
    assert got == expected


def test_the_saved_state_holds_every_detector_per_run():
    bus = EmbeddedBus(partitions=1)
    publish(bus, steps()[:100])
    worker = cohosted_worker(bus, snapshot_interval_s=3600)
    drain([worker])
    state = worker.stage.snapshot(["run-1", "run-2"])
    assert set(state) == {"run-1", "run-2"}
    assert all(set(per) == set(DETECTOR_NAMES) for per in state.values())
    fresh = CoHostedDetectors([build_stage(name, SETTINGS, TOPICS) for name in DETECTOR_NAMES])
    fresh.restore(json.loads(json.dumps(state)))  # as read back from the state topic
    assert json.loads(json.dumps(fresh.snapshot(["run-1", "run-2"]))) == json.loads(
        json.dumps(state)
    )


def test_a_checkpoint_saves_only_the_runs_changed_since_the_last_one():
    # The periodic save writes a run's four detector states only if a batch touched the run:
    # an idle run costs the save nothing, however many runs the worker holds.
    bus = EmbeddedBus(partitions=1)
    events = steps()
    publish(bus, events[:100])
    worker = cohosted_worker(bus, snapshot_interval_s=0)  # a checkpoint after every batch
    drain([worker])
    store = TOPICS.state("detectors")
    assert {r.key for r in bus.read_all(store)} >= {b"detectors/run/run-1", b"detectors/run/run-2"}
    saved = max(r.offset for r in bus.read_all(store))  # (compacted: read by offset, not by index)
    publish(bus, [e for e in events[100:160] if e.run_id == "run-1"])
    drain([worker])
    after = [r.key for r in bus.read_all(store) if r.offset > saved]
    assert b"detectors/run/run-1" in after
    assert all(
        not key.startswith(b"detectors/run/") or key == b"detectors/run/run-1" for key in after
    )
