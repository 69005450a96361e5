"""A worker woken by a few records waits ``batch_linger_s`` for more and works on them as one batch.

In the embedded pipeline every wake-up of a worker thread costs the trainer's
process a GIL hand-off, a state snapshot, a flush and a round of metrics: the
linger turns per-record wake-ups into per-batch ones. The records that arrive
while it waits are published here from inside the wait (the worker's
``_pause``), so what joins the batch does not depend on timing.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.metrics import Metrics
from spikeguard.processors.detector_stage import DetectorStage
from spikeguard.processors.detectors.statistical import StatisticalDetector
from spikeguard.schemas import StepEvent, Topics, encode
from spikeguard.streaming.worker import Worker

TOPICS = Topics("linger-test.")


class Recording(DetectorStage):
    """The real detector stage, noting the size of every batch it is handed."""

    def __init__(self) -> None:
        super().__init__(TOPICS, "statistical", lambda run_id: StatisticalDetector())
        self.batches: list[int] = []

    def handle_batch(self, items):
        self.batches.append(len(items))
        return super().handle_batch(items)


def step(s: int) -> StepEvent:
    return StepEvent(
        run_id="r", step=s, time=1000.0 + s, loss=1.0 + 0.01 * s, grad_norm=1.0, lr=1e-3
    )


def setup(linger: float, max_records: int = 1000):
    bus = EmbeddedBus(partitions=1)
    stage = Recording()
    worker = Worker(
        bus,
        stage,
        snapshots=False,
        batch_linger_s=linger,
        max_records=max_records,
        metrics=Metrics(CollectorRegistry()),
    )
    producer = bus.producer()
    pauses: list[float] = []

    def publish(steps):
        for s in steps:
            producer.publish(TOPICS.steps, encode(step(s)), key="r")

    def arriving_while_paused(seconds: float) -> None:
        pauses.append(seconds)
        publish(range(1 + 4 * (len(pauses) - 1), 1 + 4 * len(pauses)))  # 4 more steps come in

    worker._pause = arriving_while_paused  # type: ignore[method-assign]
    return bus, stage, worker, publish, pauses


def test_records_arriving_during_the_linger_join_the_batch():
    bus, stage, worker, publish, pauses = setup(linger=0.01)
    publish([0])
    assert worker.run_once(timeout=0) == 5
    assert stage.batches == [5] and pauses == [0.01]
    assert len(bus.read_all(TOPICS.verdicts)) == 5  # all judged, in one batch


def test_without_a_linger_the_worker_works_on_what_woke_it():
    bus, stage, worker, publish, pauses = setup(linger=0.0)
    publish([0])
    assert worker.run_once(timeout=0) == 1
    assert stage.batches == [1] and pauses == []


def test_a_full_batch_does_not_wait_and_an_empty_poll_does_not_either():
    bus, stage, worker, publish, pauses = setup(linger=0.01, max_records=3)
    assert worker.run_once(timeout=0) == 0 and pauses == []
    publish(range(100, 103))
    assert worker.run_once(timeout=0) == 3
    assert pauses == [] and stage.batches == [3]


def test_the_linger_never_takes_more_than_max_records():
    bus, stage, worker, publish, pauses = setup(linger=0.01, max_records=3)
    publish([0])
    assert worker.run_once(timeout=0) == 3  # 1 + 2 of the 4 that came in
    # The 2 left wake it again; 4 more come in while it waits, of which it takes 1.
    assert worker.run_once(timeout=0) == 3
    assert stage.batches == [3, 3] and len(pauses) == 2


def test_stop_cuts_the_linger_short():
    bus = EmbeddedBus(partitions=1)
    worker = Worker(
        bus,
        Recording(),
        snapshots=False,
        batch_linger_s=1000.0,
        metrics=Metrics(CollectorRegistry()),
    )
    bus.producer().publish(TOPICS.steps, encode(step(0)), key="r")
    thread = threading.Thread(target=worker.run)
    thread.start()
    worker.stop()
    thread.join(timeout=60)  # a generous bound, not a timing assertion: the linger is 1000 s
    assert not thread.is_alive()
    assert worker.failure is None


def test_embedded_runtime_workers_linger_by_the_setting():
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    for linger in (0.0, 0.25):
        # Threads: the workers' objects are then this process's to look at.
        settings = load_settings(
            {"worker": {"embedded_batch_linger_s": linger, "embedded_process": False}}, env={}
        )
        runtime = open_runtime(settings)
        try:
            assert runtime.workers and {w.batch_linger_s for w in runtime.workers} == {linger}
        finally:
            runtime.close()
