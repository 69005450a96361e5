"""The periodic save writes only the runs changed since the last one (fusion, on a real worker)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import build_stage
from spikeguard.metrics import Metrics
from spikeguard.schemas import Topics, Verdict, encode
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

TOPICS = Topics("dirty-test.")
DETECTORS = ("statistical", "rules", "ml", "predictor")


def publish(bus: EmbeddedBus, runs: str, steps: range) -> None:
    producer = bus.producer()
    for run_id in runs:
        for step in steps:
            for name in DETECTORS:  # whole steps: decided at once, nothing left for a deadline
                v = Verdict(
                    run_id=run_id,
                    step=step,
                    detector=name,
                    is_anomaly=False,
                    loss=2.0,
                    grad_norm=1.0,
                )
                producer.publish(TOPICS.verdicts, encode(v), key=run_id)


def drain(worker: Worker) -> None:
    while worker.run_once(timeout=0):
        pass


def test_fusion_saves_only_the_runs_a_batch_touched_since_the_last_checkpoint():
    bus = EmbeddedBus(partitions=1)
    stage = build_stage("fusion", load_settings({"topic_prefix": TOPICS.prefix}, env={}), TOPICS)
    worker = Worker(bus, stage, metrics=Metrics(CollectorRegistry()), snapshot_interval_s=0)
    publish(bus, "abc", range(5))
    drain(worker)
    store = TOPICS.state("fusion")
    assert {r.key for r in bus.read_all(store)} >= {
        b"fusion/run/a",
        b"fusion/run/b",
        b"fusion/run/c",
    }
    saved = max(r.offset for r in bus.read_all(store))  # (compacted: read by offset, not by index)
    publish(bus, "b", range(5, 8))
    drain(worker)
    worker.checkpoint()  # nothing changed since: writes no run
    after = [r.key for r in bus.read_all(store) if r.offset > saved]
    assert [key for key in after if key.startswith(b"fusion/run/")] == [b"fusion/run/b"]


def test_partitions_come_due_one_at_a_time_oldest_first_and_all_once_twice_overdue():
    # The periodic save takes one partition per batch (the one saved longest ago), so no
    # batch waits for every partition's save; a loop too slow for that saves the overdue too.
    bus = EmbeddedBus(partitions=4)
    stage = build_stage("fusion", load_settings({"topic_prefix": TOPICS.prefix}, env={}), TOPICS)
    worker = Worker(bus, stage, metrics=Metrics(CollectorRegistry()), snapshot_interval_s=3600)
    publish(bus, "abcdefgh", range(3))
    drain(worker)
    saver, runs = worker._saver, worker._run_partition
    partitions = set(runs.values())
    assert len(partitions) >= 2
    now, interval = time.monotonic(), 1000.0  # (the worker's loop counts on the monotonic clock)
    assert (
        saver.due(now, interval, runs) == []
    )  # dirty since the first batch, less than an interval
    first = saver.due(now + interval, interval, runs)
    assert len(first) == 1
    saver.save(worker._producer, runs, first, now=now + interval)
    second = saver.due(now + interval + 0.1, interval, runs)
    assert len(second) == 1 and second != first  # the next oldest, not the one just saved
    assert sorted(saver.due(now + 2 * interval, interval, runs)) == sorted(partitions - set(first))
    saved = saver.save(worker._producer, runs, second, now=now + interval + 0.1)
    # What may be committed: the saved partition's positions, no other partition's.
    assert {p for _, p in saved} == set(second)
    assert saved == {tp: n for tp, n in saver.positions.items() if tp[1] in second}
