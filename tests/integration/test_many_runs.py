"""10,000 concurrent runs on one detector worker: every verdict out, the worker alive, no state
record near the broker's limit, and every run's memory given back when the runs end.

Why: with one state record per partition, ~6,500 runs passed the broker's 1 MB limit and
the worker died for good. The embedded test runs by default; the Kafka one (real broker, the
``spikeguard worker`` process) is marked kafka and slow.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import build_stage
from spikeguard.metrics import Metrics
from spikeguard.schemas import RunEvent, StepEvent, Topics, Verdict, decode, encode
from spikeguard.settings import load_settings
from spikeguard.streaming.footprint import deep_size
from spikeguard.streaming.state_store import StateStore
from spikeguard.streaming.worker import Worker

RUNS = 10_000
STEPS = 3
TOPICS = Topics("many.")


def run_ids() -> list[str]:
    return [f"run-{i:05d}" for i in range(RUNS)]


def step_event(run_id: str, step: int) -> StepEvent:
    # A fixed, run-dependent trace: no randomness, every run slightly different.
    n = int(run_id[4:])
    return StepEvent(
        run_id=run_id,
        step=step,
        loss=2.0 + (n % 97) * 0.01 - step * 0.001,
        grad_norm=1.0 + (n % 13) * 0.05,
        lr=1e-3,
        time=0.0,
    )


def end_event(run_id: str) -> RunEvent:
    return RunEvent(run_id=run_id, kind="end", step=STEPS, finished=True, reason="finished")


def drain(worker: Worker) -> None:
    while worker.run_once(timeout=0):
        pass


def per_run_bytes(stage, worker) -> int:
    """What the stage and the worker hold, runs and all (not the bus, not shared code)."""
    return deep_size(
        stage.runs,
        stage.last_seen,
        stage._newest,
        stage._judged,
        stage._ending,
        worker._run_partition,
    )


@pytest.mark.heavy
def test_ten_thousand_runs_on_one_embedded_worker():
    bus = EmbeddedBus(partitions=4)
    settings = load_settings({"topic_prefix": TOPICS.prefix}, env={})
    stage = build_stage("statistical", settings, TOPICS)
    worker = Worker(
        bus,
        stage,
        metrics=Metrics(CollectorRegistry()),
        snapshot_interval_s=3600,
        metrics_linger_s=0,
    )
    empty = per_run_bytes(stage, worker)
    producer = bus.producer()
    for step in range(STEPS):  # all runs at once: 10,000 concurrent runs
        producer.publish_events((TOPICS.steps, step_event(run, step)) for run in run_ids())
    drain(worker)
    worker.checkpoint()

    assert worker.failure is None
    got = {
        (v.run_id, v.step)
        for v in (decode(r.value, Verdict) for r in bus.read_all(TOPICS.verdicts))
    }
    assert got == {(run, step) for run in run_ids() for step in range(STEPS)}
    assert len(stage.runs) == RUNS
    records = bus.read_all(TOPICS.state("statistical"))
    assert len(records) == RUNS + 4  # one per run, one per partition
    largest = max(len(r.value) for r in records)
    assert largest < 20_000, largest  # ~1 MB was one partition's record at 6,500 runs
    held = per_run_bytes(stage, worker) - empty
    print(
        f"\n10,000 runs: {held / RUNS:,.0f} bytes per run in memory, "
        f"{held / 2**20:.1f} MiB in all; largest state record {largest:,} bytes"
    )

    bus.create_topics([TOPICS.runs], compacted=True)
    producer.publish_events((TOPICS.runs, end_event(run)) for run in run_ids())
    drain(worker)
    worker.checkpoint()
    gc.collect()
    assert stage.runs == {} and worker._run_partition == {}
    left = per_run_bytes(stage, worker) - empty
    print(f"after the runs ended: {left} bytes held ({left / RUNS:.2f} per run)")
    assert left < 0.001 * held  # ~0: what is left does not grow with the runs ended
    store = StateStore(bus, TOPICS.state("statistical"))
    assert all(store.load(p)["runs"] == {} for p in range(4))  # all tombstoned
    # And still alive and judging.
    producer.publish_events([(TOPICS.steps, step_event("run-99999", 0))])
    drain(worker)
    assert "run-99999" in stage.runs and worker.failure is None


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def latest(records) -> dict:
    """Key -> newest value (None: tombstoned), as compaction will leave it."""
    return {record.key: record.value for record in records}


#: Reading the state topic back (tens of thousands of records) on a loaded machine: a bound on a
#: hung read, not a speed check.
READ_S = 120.0


@pytest.mark.kafka
@pytest.mark.slow
def test_ten_thousand_runs_on_one_kafka_worker(kafka_bootstrap, tmp_path):
    from spikeguard.bus.kafka import KafkaBus

    prefix = f"many-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    bus = KafkaBus(kafka_bootstrap)
    bus.create_topics(topics.all())
    bus.create_topics([topics.runs], compacted=True)
    producer = bus.producer()
    for step in range(STEPS):
        for run in run_ids():
            producer.publish(topics.steps, encode(step_event(run, step)), key=run)
    producer.flush()

    log = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}
    worker = subprocess.Popen(
        # --insecure: the runs here are unsigned (what is measured is memory, not trust)
        [
            sys.executable,
            "-m",
            "spikeguard",
            "worker",
            "statistical",
            "--topic-prefix",
            prefix,
            "--set",
            "snapshot_interval_s=1",
            "--insecure",
        ],
        env={**env, "SPIKEGUARD_BOOTSTRAP_SERVERS": kafka_bootstrap},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 600
        verdicts: set[tuple[str, int]] = set()
        consumer = bus.consumer(f"{prefix}reader", [topics.verdicts])
        while len(verdicts) < RUNS * STEPS:
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            for record in consumer.poll(5000, 1.0):
                v = decode(record.value, Verdict)
                verdicts.add((v.run_id, v.step))
        assert verdicts == {(run, step) for run in run_ids() for step in range(STEPS)}
        loaded_rss = rss_bytes(worker.pid)
        while True:  # every run saved (the worker saves every second), one record each
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            newest = latest(bus.read_all(topics.state("statistical"), timeout=READ_S))
            if sum(b"/run/" in k for k in newest) >= RUNS:
                break
            time.sleep(2.0)
        largest = max(len(v) for v in newest.values() if v is not None)
        assert largest < 20_000, largest

        for run in run_ids():
            producer.publish(topics.runs, encode(end_event(run)), key=run)
        producer.flush()
        # Until every run's state record is tombstoned (the worker saves every second).
        while True:
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            newest = latest(bus.read_all(topics.state("statistical"), timeout=READ_S))
            live = [k for k, v in newest.items() if v is not None and b"/run/" in k]
            if newest and not live:
                break
            time.sleep(2.0)
        print(
            f"\nKafka worker, 10,000 runs: RSS {loaded_rss / 2**20:.0f} MiB loaded, "
            f"{rss_bytes(worker.pid) / 2**20:.0f} MiB after the runs ended; "
            f"largest state record {largest:,} bytes"
        )
        assert loaded_rss < 2**30
        assert worker.poll() is None  # alive
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    assert worker.returncode == 0, log.read_text()
    bus.close()
