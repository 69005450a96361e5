"""Backtest and replay: the pipeline over recorded events, deterministically.

It runs on the embedded bus, single-threaded, stage after stage until every
topic is drained, so the same input always gives the same decisions, whatever
the machine's load. It is the same code that runs live; only the pump differs.
Live deadlines (wall-clock, steps behind) exist for liveness when a detector is
slow or down; here every verdict is known to arrive, so fusion waits for all of
them (deadlines pushed out of reach) and decides the rest at the end.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from pydantic import BaseModel

from spikeguard.bus import EmbeddedBus
from spikeguard.metrics import Metrics
from spikeguard.streaming.worker import Worker
from spikeguard.schemas import CheckpointEvent, Decision, StepEvent, Topics, Verdict
from spikeguard.settings import Settings, load_settings

JUDGES = ("statistical", "rules", "ml", "predictor", "fusion")
_NEVER = 10**12


class _StagedTopics(Topics):
    """The pipeline's topics, but detectors' verdicts go to a staging topic."""

    @property
    def verdicts(self) -> str:
        return self.prefix + "offline.staged-verdicts"


def offline(settings: Settings) -> Settings:
    """The same settings with fusion's live deadlines out of reach."""
    fusion = settings.fusion.model_copy(
        update={"deadline_seconds": _NEVER, "deadline_steps": _NEVER, "max_pending": _NEVER}
    )
    # Offline steps come from a file the user chose, not from a live trainer:
    # there is no run to steer, so they are judged without step signatures.
    return settings.model_copy(update={"fusion": fusion, "signing_key": None})


@contextmanager
def paused_gc() -> Iterator[None]:
    """No automatic cyclic GC during an allocation-heavy offline run.

    Every hop allocates small objects, and the bus keeps most of them (every
    record stays readable), so each collection walks a heap that only grows:
    ~20% of backtest time at a raised threshold, more at the default. The
    pipeline makes no reference cycles per step (the ML detector's refits leave
    a few dozen objects each), and :func:`_run_offline` breaks the ones its
    workers and bus make, so everything is still freed by reference counting;
    what little cyclic garbage there is waits for the next collection.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def run_offline(
    inputs: Sequence[tuple[str, BaseModel]],
    settings: Settings,
    components: Sequence[str],
    outputs: dict[str, type[BaseModel]],
    metrics: Metrics | None = None,
) -> dict[str, list[BaseModel]]:
    """Publish ``inputs`` (topic, event), run ``components`` until idle, read ``outputs``."""
    with paused_gc():
        return _run_offline(inputs, settings, components, outputs, metrics)


def _run_offline(
    inputs: Sequence[tuple[str, BaseModel]],
    settings: Settings,
    components: Sequence[str],
    outputs: dict[str, type[BaseModel]],
    metrics: Metrics | None,
) -> dict[str, list[BaseModel]]:
    from spikeguard.components import DETECTOR_NAMES, build_stage

    settings = offline(settings)
    topics = Topics(settings.topic_prefix)
    staged = _StagedTopics(settings.topic_prefix)
    bus = EmbeddedBus(partitions=1)  # one partition: a single, total order
    metrics = metrics or Metrics(CollectorRegistry())
    producer = bus.producer()
    producer.publish_events(inputs)

    def worker(name: str) -> Worker:
        # Detectors write to a staging topic; the pump below hands their
        # verdicts on to fusion in the order a live pipeline would see them.
        stage_topics = staged if name in DETECTOR_NAMES else topics
        return Worker(bus, build_stage(name, settings, stage_topics), metrics=metrics,
                      snapshots=False, max_records=2000)

    detectors = [worker(name) for name in components if name in DETECTOR_NAMES]
    others = [worker(name) for name in components if name not in DETECTOR_NAMES]
    workers = detectors + others
    stager = bus.consumer("offline.stager", [staged.verdicts])
    # Where each step stands in the input: verdicts are released in that order.
    order = {
        (e.run_id, e.epoch, e.step): i  # type: ignore[attr-defined]
        for i, (topic, e) in enumerate(inputs)
        if topic == topics.steps
    }
    readers = {topic: bus.consumer(f"offline.reader.{topic}", [topic]) for topic in outputs}
    busy = True
    while busy:
        busy = False
        # One batch per detector: they all read the same steps, so a round
        # covers the same stretch of steps for each of them.
        for detector in detectors:
            busy = bool(detector.run_once(timeout=0)) or busy
        if batch := stager.poll(10**9, timeout=0):
            verdicts = [record.decoded(Verdict) for record in batch]
            verdicts.sort(key=lambda v: order.get((v.run_id, v.epoch, v.step), len(order)))
            producer.publish_events([(topics.verdicts, v) for v in verdicts])
        for other in others:
            while other.run_once(timeout=0):
                busy = True
        if not busy:  # end of input: stages emit what they hold, which may feed the next
            busy = any(w.drain() for w in workers)
    found: dict[str, list[BaseModel]] = {}
    for topic, model in outputs.items():
        found[topic] = events = []
        while batch := readers[topic].poll(10_000, timeout=0):
            events.extend(record.decoded(model) for record in batch)
    # Leave no reference cycle behind (worker <-> consumer, bus <-> group
    # member): the records are then freed as soon as the bus is dropped.
    for worker in workers:
        worker.close()
    for reader in (*readers.values(), stager):
        reader.close()
    bus.close()
    return found


def backtest_events(
    events: Iterable[StepEvent],
    settings: Settings | None = None,
    *,
    metrics: Metrics | None = None,
) -> list[Decision]:
    """Every decision fusion makes for ``events`` (all runs), in publication order."""
    settings = settings or load_settings(env={})
    topics = Topics(settings.topic_prefix)
    with paused_gc():  # already while the inputs are listed: they stay to the end
        found = run_offline(
            [(topics.steps, event) for event in events],
            settings,
            JUDGES,
            {topics.decisions: Decision},
            metrics,
        )
    return found[topics.decisions]  # type: ignore[return-value]


def replay_events(
    steps: Iterable[StepEvent],
    checkpoints: Iterable[CheckpointEvent],
    settings: Settings,
) -> dict[str, list[BaseModel]]:
    """Re-judge a recorded run: decisions and the actions the policy would take now."""
    from spikeguard.schemas import Action

    topics = Topics(settings.topic_prefix)
    inputs: list[tuple[str, BaseModel]] = [(topics.steps, e) for e in steps]
    inputs += [(topics.checkpoints, c) for c in checkpoints]
    return run_offline(
        inputs,
        settings,
        (*JUDGES, "actuator"),
        {topics.decisions: Decision, topics.actions: Action},
    )
