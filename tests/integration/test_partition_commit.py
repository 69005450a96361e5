"""Per-partition saves and commits on a real broker.

The co-hosted detectors and fusion run as real Workers on the real broker.
The detectors save one input partition at a time, and each partition is
committed at exactly the positions its saved state includes, never past them.
The detector worker is killed mid-stream (no final save, no commit, unsent
outputs dropped) and a new one takes over: every step is still decided
exactly once, with the decision the backtest gives it.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from kafka import KafkaConsumer, TopicPartition
from prometheus_client import CollectorRegistry

from spikeguard.bus.kafka import KafkaBus
from spikeguard.components import DETECTOR_NAMES, build_stage
from spikeguard.lab.backtest import run_offline
from spikeguard.lab.simulate import generate
from spikeguard.metrics import Metrics
from spikeguard.processors.cohosted_stage import CoHostedDetectors
from spikeguard.schemas import Decision, Topics, decode, encode, sign_step
from spikeguard.settings import load_settings
from spikeguard.streaming.state_store import StateStore
from spikeguard.streaming.worker import Worker

pytestmark = pytest.mark.kafka
KEY = "partition-commit-key-0123456789abcdef"
RUNS = 8  # over the bus's 4 partitions
STEPS = 200


def committed(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offset of each partition of ``topic`` that has one."""
    reader = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        found = {
            p: reader.committed(TopicPartition(topic, p))
            for p in reader.partitions_for_topic(topic)
        }
    finally:
        reader.close()
    return {p: getattr(c, "offset", c) for p, c in found.items() if c is not None}


def detectors(bus: KafkaBus, settings, topics: Topics, interval_s: float) -> Worker:
    stage = CoHostedDetectors([build_stage(name, settings, topics) for name in DETECTOR_NAMES])
    return Worker(
        bus,
        stage,
        metrics=Metrics(CollectorRegistry()),
        max_records=20,
        snapshot_interval_s=interval_s,
        poll_timeout_s=0.5,
    )


def test_each_partition_is_committed_at_its_saved_state_and_a_kill_decides_every_step_once(
    kafka_bootstrap,
):
    prefix = f"pcommit-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    # Fusion waits for every detector however slow a loaded machine makes it: this test is about
    # commits, and a step decided without a late detector would differ from the backtest.
    settings = load_settings(
        {"topic_prefix": prefix, "signing_key": KEY, "fusion.deadline_seconds": 600}, env={}
    )
    runs = [
        generate("sudden_spike" if r % 2 else "stable", STEPS, r, run_id=f"pc-run-{r}").events
        for r in range(RUNS)
    ]
    steps = [sign_step(e, KEY) for many in zip(*runs) for e in many]

    bus = KafkaBus(kafka_bootstrap)
    bus.create_topics([topics.steps])
    producer = bus.producer()
    for event in steps:
        producer.publish(topics.steps, encode(event), key=event.run_id)
    producer.flush()

    first = detectors(bus, settings, topics, interval_s=0.05)
    store = StateStore(bus, topics.state("detectors"))
    partial = 0  # checkpoints that saved some of the partitions read, not all
    deadline = time.monotonic() + 120
    while partial < 3:
        assert time.monotonic() < deadline, "no partition was saved on its own"
        before = dict(first._saver._saved_at)
        first.run_once()
        saved_now = {p for p, at in first._saver._saved_at.items() if before.get(p) != at}
        if saved_now and len(saved_now) < len({p for _, p in first._saver.positions}):
            partial += 1
    first.snapshot_interval_s = 3600
    processed, deadline = 0, time.monotonic() + 60
    while processed < 3 * 20:  # three batches processed, never saved nor committed: redone
        assert time.monotonic() < deadline, "the worker read nothing more"
        processed += first.run_once()  # (a poll on a loaded machine may come back empty)
    assert sum(first._saver.positions.values()) < len(steps)  # killed mid-stream
    first._producer.flush()  # (so that what follows reads a settled state topic)
    store.invalidate()
    group_offsets = committed(kafka_bootstrap, f"{prefix}detectors", topics.steps)
    assert group_offsets
    for partition, offset in group_offsets.items():
        # Committed exactly where the partition's saved state is, never past it.
        assert store.load(partition)["offsets"][topics.steps] == offset
    # Killed with work done past its commits: on a partition committed before, or on one whose
    # records it read but has not saved yet (none committed: the group restarts it from 0).
    assert any(
        position > group_offsets.get(p, 0)
        for (topic, p), position in first._saver.positions.items()
        if topic == topics.steps
    )
    first._consumer.close()  # killed: no final save, no commit

    second = detectors(bus, settings, topics, interval_s=0.05)
    fusion = Worker(
        bus,
        build_stage("fusion", settings, topics),
        metrics=Metrics(CollectorRegistry()),
        poll_timeout_s=0.5,
    )
    deadline = time.monotonic() + 180
    while True:
        if second.run_once() + fusion.run_once():
            continue
        decided = by_step(bus, topics, timeout=2)
        if len(decided) >= len(steps):
            break
        assert time.monotonic() < deadline, f"{len(decided)} of {len(steps)} steps decided"
    second.close()
    fusion.close()
    first._producer.close()

    offline = run_offline(
        [(topics.steps, e) for e in steps],
        settings,
        [*DETECTOR_NAMES, "fusion"],
        {topics.decisions: Decision},
    )[topics.decisions]
    expected = by_step_of(offline)
    decided = by_step(bus, topics, timeout=10)
    assert set(decided) == set(expected)
    # One decision per step (a redone step's decision is the same record again), the backtest's.
    assert all(len(found) == 1 for found in decided.values())
    assert decided == expected
    bus.close()


def by_step_of(decisions) -> dict[tuple[str, int], set[str]]:
    found: dict[tuple[str, int], set[str]] = {}
    for d in decisions:
        text = json.dumps(d.model_dump(mode="json", exclude={"signature"}), sort_keys=True)
        found.setdefault((d.run_id, d.step), set()).add(text)
    return found


def by_step(bus: KafkaBus, topics: Topics, timeout: float) -> dict[tuple[str, int], set[str]]:
    return by_step_of(
        decode(r.value, Decision) for r in bus.read_all(topics.decisions, timeout=timeout)
    )
