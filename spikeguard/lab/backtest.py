"""Backtest and replay: the pipeline over recorded events, deterministically.

It runs on the embedded bus, single-threaded, stage after stage until every
topic is drained, so the same input always gives the same decisions, whatever
the machine's load. It is the same code that runs live; only the pump differs.
Live deadlines (wall-clock, steps behind) exist for liveness when a detector is
slow or down; here every verdict is known to arrive, so fusion waits for all of
them (deadlines pushed out of reach) and decides the rest at the end.

Input goes in segments (:class:`OfflinePipeline`), each run until every stage
is idle, so a backtest's memory is one segment's whatever the file's length,
and a replay can hand the actuator each checkpoint when the live run did.
A backtest (steps in, decisions out) needs no bus between its stages:
:func:`backtest_stream` hands them the same batches directly
(:class:`~spikeguard.lab.backtest_pump.DirectPipeline`): no records, offsets or
per-record metrics; a replay, with the actuator and its checkpoints, keeps the bus pump.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from itertools import islice
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

from pydantic import BaseModel

from spikeguard.schemas import Ack, CheckpointEvent, Decision, StepEvent, Topics, Verdict
from spikeguard.settings import Settings, load_settings

from spikeguard.lab.backtest_pump import BATCH, DirectPipeline

if TYPE_CHECKING:  # a backtest (the direct pump) needs no bus, worker or metrics: not imported
    from spikeguard.metrics import Metrics
    from spikeguard.streaming.worker import Worker

JUDGES = ("statistical", "rules", "ml", "predictor", "fusion")
_NEVER = 10**12
#: Steps per segment of a streamed backtest: a multiple of BATCH (see OfflinePipeline).
SEGMENT_STEPS = 2 * BATCH  # ~55 MiB of records and events on top of ~140 MiB of imports


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
    return settings.model_copy(
        update={
            "fusion": fusion,
            "signing_key": None,
            "trainer_key": None,
            "detectors_key": None,
            "fusion_key": None,
            "actuator_key": None,
        }
    )


@contextmanager
def paused_gc() -> Iterator[None]:
    """No automatic cyclic GC while a segment runs.

    Every hop allocates small objects, and the segment's bus keeps them all
    (every record stays readable) until the segment ends, so each collection
    would walk a heap that only grows: ~20% of backtest time at a raised
    threshold, more at the default. The pipeline makes no reference cycles per
    step (the ML detector's refits leave a few dozen objects each), and
    :meth:`OfflinePipeline._segment` breaks the ones its workers and bus make,
    so everything is still freed by reference counting; what little cyclic
    garbage there is waits for a collection between segments.
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
    pipeline = OfflinePipeline(settings, components, outputs, metrics)
    found = pipeline.feed(inputs)
    for topic, events in pipeline.finish().items():
        found[topic] += events
    return found


class OfflinePipeline:
    """The pipeline fed segment by segment, so memory is one segment's, not the file's.

    The stages (and so every run's state) live across segments; each segment
    runs on a bus of its own, dropped when the segment is idle, because the
    embedded bus keeps every record it was given. A segment ends only once
    every stage is idle, which is a point the pump passes anyway, so splitting
    the input at a multiple of the detectors' batch (:data:`BATCH`) gives the
    same batches, verdict order and decisions as one segment holding it all.
    """

    def __init__(
        self,
        settings: Settings,
        components: Sequence[str],
        outputs: dict[str, type[BaseModel]],
        metrics: Metrics | None = None,
    ) -> None:
        from prometheus_client import CollectorRegistry

        from spikeguard.components import DETECTOR_NAMES, build_stage
        from spikeguard.metrics import Metrics

        settings = offline(settings)
        self.topics = Topics(settings.topic_prefix)
        self._staged = _StagedTopics(settings.topic_prefix)
        self.outputs = dict(outputs)
        self.metrics = metrics or Metrics(CollectorRegistry())
        # Detectors write to a staging topic; the pump hands their verdicts
        # on to fusion in the order a live pipeline would see them.
        self._detectors = [
            build_stage(name, settings, self._staged)
            for name in components
            if name in DETECTOR_NAMES
        ]
        self._others = [
            build_stage(name, settings, self.topics)
            for name in components
            if name not in DETECTOR_NAMES
        ]

    def feed(self, inputs: Sequence[tuple[str, BaseModel]]) -> dict[str, list[BaseModel]]:
        """Run ``inputs`` through until every stage is idle; what reached the outputs."""
        with paused_gc():
            return self._segment(inputs, drain=False)

    def finish(self) -> dict[str, list[BaseModel]]:
        """End of input: the stages emit what they still hold; what reached the outputs."""
        with paused_gc():
            return self._segment((), drain=True)

    def _segment(
        self, inputs: Sequence[tuple[str, BaseModel]], drain: bool
    ) -> dict[str, list[BaseModel]]:
        from spikeguard.bus import EmbeddedBus
        from spikeguard.streaming.worker import Worker

        topics, staged = self.topics, self._staged
        bus = EmbeddedBus(partitions=1)  # one partition: a single, total order
        producer = bus.producer()
        producer.publish_events(inputs)

        def worker(stage) -> Worker:
            return Worker(bus, stage, metrics=self.metrics, snapshots=False, max_records=BATCH)

        detectors = [worker(stage) for stage in self._detectors]
        others = [worker(stage) for stage in self._others]
        workers = detectors + others
        stager = bus.consumer("offline.stager", [staged.verdicts])
        # Where each step stands in the input: verdicts are released in that order.
        # A step given twice (a replay, which the detectors refuse) keeps its first
        # place: at the second, fusion would have decided past it and drop its verdicts.
        order: dict[tuple, int] = {}
        for i, (topic, e) in enumerate(inputs):
            if topic == topics.steps:
                order.setdefault((e.run_id, e.epoch, e.step), i)  # type: ignore[attr-defined]
        readers = {
            topic: bus.consumer(f"offline.reader.{topic}", [topic]) for topic in self.outputs
        }
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
            if not busy and drain:  # stages emit what they hold, which may feed the next
                busy = any(w.drain() for w in workers)
        found: dict[str, list[BaseModel]] = {}
        for topic, model in self.outputs.items():
            events: list[BaseModel] = []
            found[topic] = events
            while batch := readers[topic].poll(10_000, timeout=0):
                events.extend(record.decoded(model) for record in batch)
        # Leave no reference cycle behind (worker <-> consumer, bus <-> group
        # member): the segment's records are then freed as soon as the bus is dropped.
        for w in workers:
            w.close()
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
    return list(backtest_stream(events, settings, metrics=metrics))


def backtest_stream(
    events: Iterable[StepEvent],
    settings: Settings | None = None,
    *,
    metrics: Metrics | None = None,
    segment_steps: int = SEGMENT_STEPS,
) -> Iterator[Decision]:
    """:func:`backtest_events` as it goes: decisions come while ``events`` is still read.

    Memory stays that of one segment (``segment_steps`` steps) whatever the
    length of ``events``; the decisions are the same for any multiple of BATCH.
    The stages are driven directly (:class:`~.backtest_pump.DirectPipeline`),
    with the batches the bus pump (:class:`OfflinePipeline`) would give them.
    """
    if segment_steps <= 0 or segment_steps % BATCH:
        raise ValueError(
            f"segment_steps must be a positive multiple of {BATCH}, got {segment_steps}"
        )
    pipeline = DirectPipeline(offline(settings or load_settings(env={})), metrics)
    events = iter(events)
    while True:
        # Reading a segment makes ~100k small objects: with the collector on, each
        # pass would walk the whole heap (the models, the forest) for nothing.
        with paused_gc():  # not around the yield: the caller's code runs there
            segment = list(islice(events, segment_steps))
            last = len(segment) < segment_steps
            decisions = pipeline.feed(segment)
            if last:
                decisions += pipeline.finish()
        yield from decisions
        if last:
            return


def replay_events(
    steps: Iterable[StepEvent],
    checkpoints: Iterable[CheckpointEvent],
    settings: Settings,
    acks: Iterable[Ack] = (),
) -> dict[str, list[BaseModel]]:
    """Re-judge a recorded run: decisions and the actions the policy would take now.

    The actuator must learn of each checkpoint when the live one did: after
    the steps before it were decided, not all up front (a checkpoint taken
    after a rollback, or the deletion of the rollback's target, would change
    the rollback). So the steps run up to each checkpoint, the pipeline goes
    idle, and only then is the checkpoint published. The trainer's acks go in
    the same way, where the trainer sent them: without them the actuator never
    hears that its rollback was applied (it alerts "not acknowledged", and its
    LR restores after the rollback never come).
    """
    from spikeguard.schemas import Action

    topics = Topics(settings.topic_prefix)
    outputs: dict[str, type[BaseModel]] = {topics.decisions: Decision, topics.actions: Action}
    pipeline = OfflinePipeline(settings, (*JUDGES, "actuator"), outputs)
    found: dict[str, list[BaseModel]] = {topic: [] for topic in outputs}

    def collect(segment_found: dict[str, list[BaseModel]]) -> None:
        for topic, events in segment_found.items():
            found[topic] += events

    for topic, segment in interleave(steps, checkpoints, topics, acks):
        collect(pipeline.feed([(topic, event) for event in segment]))
    collect(pipeline.finish())
    return found


def interleave(
    steps: Iterable[StepEvent],
    checkpoints: Iterable[CheckpointEvent],
    topics: Topics,
    acks: Iterable[Ack] = (),
) -> Iterator[tuple[str, Sequence[BaseModel]]]:
    """Steps and checkpoints in the order the live run made them, as (topic, events) segments.

    The guard saves a checkpoint of step ``s`` (the state before step ``s``)
    after publishing step ``s - 1``, and announces the checkpoints it removed
    right after the new one, under their own, older steps. So checkpoints keep
    their recorded order, a deletion travels with the checkpoint recorded just
    before it, and each such group goes in before the first step of its run at
    or past its (epoch, step). An ack goes in before the first step of its
    run the trainer published after it (by the trainer's clock: both carry the
    time they were sent; a rollback's ack comes before the re-run's first step,
    whose step number is lower). Runs of steps are cut at SEGMENT_STEPS.
    """
    answers: dict[str, list[Ack]] = {}
    for a in sorted(acks, key=lambda a: a.time):
        answers.setdefault(a.run_id, []).append(a)
    groups: dict[str, list[tuple[tuple[int, int], list[CheckpointEvent]]]] = {}
    for c in checkpoints:
        runs = groups.setdefault(c.run_id, [])
        if c.deleted and runs:
            runs[-1][1].append(c)
        else:
            runs.append(((c.epoch, c.step), [c]))
    run: list[BaseModel] = []
    for step in steps:
        queue = groups.get(step.run_id) or []
        due = 0
        while queue and due < len(queue) and queue[due][0] <= (step.epoch, step.step):
            due += 1
        if due:
            if run:
                yield topics.steps, run
                run = []
            yield topics.checkpoints, [c for _, group in queue[:due] for c in group]
            del queue[:due]
        pending = answers.get(step.run_id) or []
        sent = 0
        while pending and sent < len(pending) and pending[sent].time <= step.time:
            sent += 1
        if sent:
            if run:
                yield topics.steps, run
                run = []
            yield topics.acks, pending[:sent]
            del pending[:sent]
        run.append(step)
        if len(run) == SEGMENT_STEPS:
            yield topics.steps, run
            run = []
    if run:
        yield topics.steps, run
    rest = [c for queue in groups.values() for _, group in queue for c in group]
    if rest:
        yield topics.checkpoints, rest
    late = [a for pending in answers.values() for a in pending]
    if late:
        yield topics.acks, late
