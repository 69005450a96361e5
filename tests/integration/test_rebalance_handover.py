"""A worker hands its partitions over with its state saved and its offsets committed, on kafka-python.

The finding: every rebalance logged ``snapshot on revoke failed: RuntimeError:
Cannot block on net.run() from the IO thread itself`` (kafka-python 3.0.12
runs the rebalance listener on its IO thread, where a synchronous commit
cannot block), so the hand-over commit never happened: the new owner judged
again what the old one had judged. Here a real detector worker judges every
step, a second one joins its group on the real broker, and the first must
commit before it lets go: the steps are judged exactly once between them.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus.kafka import KafkaBus
from spikeguard.components import build_stage
from spikeguard.lab.simulate import generate
from spikeguard.metrics import Metrics
from spikeguard.schemas import Topics, Verdict, decode, encode
from spikeguard.schemas.signing import sign
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

pytestmark = pytest.mark.kafka
KEY = "handover-key-0123456789abcdef"
RUNS = [f"hand-{i}" for i in range(8)]  # spread over the 4 partitions
STEPS = 30


def test_the_first_worker_commits_on_revoke_and_the_second_judges_nothing_twice(
    kafka_bootstrap, caplog
):
    prefix = f"handover-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    settings = load_settings({"topic_prefix": prefix, "signing_key": KEY}, env={})
    buses = [KafkaBus(kafka_bootstrap, partitions=4) for _ in range(3)]
    feed, first_bus, second_bus = buses

    def worker(bus: KafkaBus) -> Worker:
        # No periodic snapshot: only the hand-over can save and commit what the first one judged.
        return Worker(
            bus,
            build_stage("statistical", settings, topics),
            metrics=Metrics(CollectorRegistry()),
            snapshot_interval_s=3600.0,
            poll_timeout_s=0.1,
        )

    def verdicts() -> list[Verdict]:
        return [decode(r.value, Verdict) for r in feed.read_all(topics.verdicts, timeout=30.0)]

    def wait(check, what: str, within_s: float = 90.0) -> None:
        deadline = time.monotonic() + within_s
        while not check():
            assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
            time.sleep(0.2)

    first = worker(first_bus)
    threads = [threading.Thread(target=first.run, daemon=True)]
    threads[0].start()
    second = None
    try:
        producer = feed.producer()
        events = {run_id: generate("sudden_spike", 200, 3, run_id=run_id).events for run_id in RUNS}
        for run_id in RUNS:
            for event in events[run_id][:STEPS]:
                producer.publish(topics.steps, encode(sign(event, KEY)), key=run_id)
        producer.flush()
        wait(lambda: len(verdicts()) >= len(RUNS) * STEPS, "the first worker judged every step")

        with caplog.at_level(logging.ERROR, logger="spikeguard.streaming.worker"):
            second = worker(second_bus)
            threads.append(threading.Thread(target=second.run, daemon=True))
            threads[1].start()
            wait(lambda: second._consumer.assignment(), "the second worker got partitions")
            # One step more per run after the hand-over: a run's verdicts keep its steps' order, so
            # once each run's new step is judged, any step judged again would be on the topic.
            for run_id in RUNS:
                producer.publish(topics.steps, encode(sign(events[run_id][STEPS], KEY)), key=run_id)
            producer.flush()
            wait(
                lambda: {v.run_id for v in verdicts() if v.step == STEPS} == set(RUNS),
                "every run's step after the hand-over judged",
            )
        assert not [r for r in caplog.records if "snapshot on revoke failed" in r.getMessage()]
        assert first.failure is None and second.failure is None
        judged = [(v.run_id, v.step) for v in verdicts()]
        assert len(judged) == len(RUNS) * (STEPS + 1) and len(set(judged)) == len(
            judged
        )  # exactly once
    finally:
        for w in (first, second):
            if w is not None:
                w.stop()
        for thread in threads:
            thread.join(30)
        for bus in buses:
            bus.close()
