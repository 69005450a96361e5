"""A worker killed with SIGKILL mid-stream and restarted produces, for every step,
the verdicts an uninterrupted run produces; and it serves its metrics over HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from spikeguard.processors.detectors import DETECTORS
from spikeguard.lab.simulate import generate
from spikeguard.schemas import Topics, Verdict, decode, encode
from spikeguard.schemas.signing import sign

pytestmark = pytest.mark.kafka
RUNS = ("crash-a", "crash-b", "crash-c")
KEY = "crash-key-0123456789abcdef"  # detector workers refuse to start on Kafka without one
STEPS = 6_000  # enough that the kill lands mid-stream


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(bootstrap, prefix, log, port, client="kafka-python"):
    env = {
        **os.environ,
        "SPIKEGUARD_BOOTSTRAP_SERVERS": bootstrap,
        "SPIKEGUARD_KAFKA_CLIENT": client,
        "SPIKEGUARD_SIGNING_KEY": KEY,
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spikeguard",
            "worker",
            "statistical",
            "--topic-prefix",
            prefix,
            # Often: what a restart redoes is what came after the last snapshot, and a worker on
            # confluent-kafka gets through several thousand records in 0.3 s.
            "--metrics-port",
            str(port),
            "--set",
            "snapshot_interval_s=0.05",
        ],
        env=env,
        stdout=log.open("a"),
        stderr=subprocess.STDOUT,
    )


def consumed(port: int) -> float:
    """Records the worker has consumed, read from its own /metrics endpoint."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("spikeguard_records_consumed_total{")
    )


def wait_for_metrics(worker, port, log, deadline):
    while True:
        try:
            return consumed(port)
        except OSError:
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)


def verdicts_by_step(bus, topics):
    found: dict[tuple[str, int], set[str]] = {}
    for record in bus.read_all(topics.verdicts, timeout=30):
        v = decode(record.value, Verdict)
        found.setdefault((v.run_id, v.step), set()).add(
            json.dumps([v.is_anomaly, v.type.value, v.confidence, v.signals], sort_keys=True)
        )
    return found


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])  # settings.kafka_client
def test_killed_worker_resumes_with_identical_verdicts(kafka_bootstrap, tmp_path, client):
    from spikeguard.bus.confluent import ConfluentBus
    from spikeguard.bus.kafka import KafkaBus

    runs = {
        run: generate("sudden_spike", STEPS, seed, run_id=run).events
        for seed, run in enumerate(RUNS)
    }
    expected = {}
    for run, events in runs.items():
        detector = DETECTORS["statistical"]()
        for v in detector.update_many(events):
            expected[(run, v.step)] = json.dumps(
                [v.is_anomaly, v.type.value, v.confidence, v.signals], sort_keys=True
            )

    prefix = f"crash-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    bus = (ConfluentBus if client == "confluent" else KafkaBus)(kafka_bootstrap)
    bus.create_topics(topics.all())
    producer = bus.producer()
    for step in range(STEPS):
        for run in RUNS:
            producer.publish(topics.steps, encode(sign(runs[run][step], KEY)), key=run)
    producer.flush()
    total = len(expected)

    log = tmp_path / "worker.log"
    port = free_port()
    worker = start_worker(kafka_bootstrap, prefix, log, port, client)
    try:
        deadline = time.monotonic() + 120
        wait_for_metrics(worker, port, log, deadline)
        while consumed(port) < total * 0.4:
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        assert b'spikeguard_records_consumed_total{component="statistical"' in metrics
        assert b"spikeguard_verdicts_total" in metrics
        worker.send_signal(signal.SIGKILL)  # mid-stream: no final snapshot, no commit
        worker.wait(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
    before = len(bus.read_all(topics.verdicts))
    assert before < total, "the worker finished before it was killed; the test proves nothing"

    port = free_port()
    restarted = start_worker(kafka_bootstrap, prefix, log, port, client)
    try:
        deadline = time.monotonic() + 180
        seen, last = -1.0, wait_for_metrics(restarted, port, log, deadline)
        # Until it has worked, gone idle and every step has its verdict: idle alone is not the end
        # on a loaded machine, where a rebalance or a slow second can pause the worker.
        while last == 0 or last != seen or not set(verdicts_by_step(bus, topics)) >= set(expected):
            assert restarted.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(1.0)
            seen, last = last, consumed(port)
    finally:
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(timeout=60)
    got = verdicts_by_step(bus, topics)
    assert set(got) == set(expected)
    for key, contents in got.items():
        # At-least-once: a step judged twice (after the crash) is judged the same way twice.
        assert contents == {expected[key]}, key
    redone = len(bus.read_all(topics.verdicts)) - total
    # It resumed from its last snapshot (every 0.05 s), not from the beginning.
    assert 0 <= redone < before / 2, (redone, before)
    assert restarted.returncode == 0, log.read_text()
    bus.close()


def test_a_worker_the_broker_refuses_exits_non_zero_with_a_one_line_reason(
    kafka_bootstrap, tmp_path
):
    """The verdicts topic takes records of at most 200 bytes: the worker's first verdicts are
    refused (MessageSizeTooLargeError, as a snapshot over 1 MB was), so it cannot go on."""
    from kafka.admin import KafkaAdminClient, NewTopic

    from spikeguard.bus.kafka import KafkaBus

    prefix = f"refused-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics(
        [NewTopic(topics.verdicts, 1, 1, topic_configs={"max.message.bytes": "200"})]
    )
    admin.close()
    bus = KafkaBus(kafka_bootstrap)
    bus.create_topics(topics.all())
    producer = bus.producer()
    for event in generate("sudden_spike", 200, 0, run_id="refused").events:
        producer.publish(topics.steps, encode(sign(event, KEY)), key="refused")
    producer.flush()

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}
    done = subprocess.run(
        [sys.executable, "-m", "spikeguard", "worker", "statistical", "--topic-prefix", prefix],
        env={**env, "SPIKEGUARD_BOOTSTRAP_SERVERS": kafka_bootstrap, "SPIKEGUARD_SIGNING_KEY": KEY},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("spikeguard worker: cannot go on: statistical: DeliveryError: "), last
    assert "MessageSizeTooLarge" in last and topics.verdicts in last, last
    # Nothing committed past the verdicts the broker refused: a restart judges those steps again.
    from kafka import KafkaConsumer, TopicPartition

    group = KafkaConsumer(
        bootstrap_servers=kafka_bootstrap, group_id=f"{prefix}statistical", enable_auto_commit=False
    )
    try:
        committed = [
            group.committed(TopicPartition(topics.steps, p))
            for p in group.partitions_for_topic(topics.steps)
        ]
    finally:
        group.close()
    assert all(getattr(c, "offset", c) in (None, 0) for c in committed), committed
    assert bus.read_all(topics.state("statistical")) == []  # and no snapshot claims them done
    bus.close()
