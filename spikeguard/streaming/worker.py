"""The worker loop: the only code that polls, publishes and commits.

poll a batch -> decode (bad records to the DLQ with the reason) -> the stage
-> publish outputs -> flush (the broker acknowledged them) -> every so often
snapshot the state with the offsets it corresponds to -> commit. A worker
never dies on a bad record, and never commits past what it has published.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict
from functools import partial
from itertools import repeat
from operator import attrgetter, is_not, itemgetter

from pydantic import BaseModel

from spikeguard.bus import Bus, Record
from spikeguard.deadletters import dead_letter
from spikeguard.errors import RecordRejected, SchemaError, SpikeguardError
from spikeguard.metrics import (
    Metrics, default_metrics, observe_ignored, observe_inputs, observe_outputs,
)
from spikeguard.streaming.stage import Output, Stage
from spikeguard.streaming.state_store import StateStore
from spikeguard.schemas import Ack, StepEvent, encode

log = logging.getLogger(__name__)

_TOPIC = attrgetter("topic")
_TOPIC_PARTITION = attrgetter("topic", "partition")
_PARTITION = attrgetter("partition")
_OFFSET = attrgetter("offset")
_TIMESTAMP = attrgetter("timestamp_ms")
_RUN_ID = attrgetter("run_id")
_EVENT = itemgetter(1)
_TOPIC_OF_OUTPUT = itemgetter(0)
_IS_NOT_NONE = partial(is_not, None)


class Worker:
    """Runs one stage against a bus, as one member of the stage's consumer group."""

    def __init__(
        self,
        bus: Bus,
        stage: Stage,
        *,
        metrics: Metrics | None = None,
        snapshots: bool = True,
        snapshot_interval_s: float = 2.0,
        max_records: int = 1000,
        poll_timeout_s: float = 0.2,
    ) -> None:
        self.bus = bus
        self.stage = stage
        self.metrics = metrics or default_metrics()
        self.max_records = max_records
        self.poll_timeout_s = poll_timeout_s
        self.snapshot_interval_s = snapshot_interval_s
        topics = stage.topics
        self.group = f"{topics.prefix}{stage.name}"
        self.dlq_topic = topics.dlq
        self._models = stage.inputs()
        self._admit = getattr(stage, "admit", None)  # optional: (topic, event) -> None or raises
        # observe_inputs looks at steps and acks only: other stages skip it.
        self._reads_steps_or_acks = any(
            issubclass(model, (StepEvent, Ack)) for model in self._models.values()
        )
        self._store = StateStore(
            bus, topics.state(stage.name),
            on_unreadable=self.metrics.unreadable_snapshots.labels(stage.name).inc,
        ) if snapshots else None
        self._producer = bus.producer()
        self._partition_runs: dict[int, set[str]] = defaultdict(set)
        self._dirty: set[int] = set()
        self._positions: dict[tuple[str, int], int] = {}
        self._last_snapshot = time.monotonic()
        self._stop = threading.Event()
        bus.create_topics(list(self._models) + [self.dlq_topic])
        if self._store is not None:
            self._store.ensure_topic()
        self._consumer = bus.consumer(
            self.group, list(self._models), on_assign=self._on_assign, on_revoke=self._on_revoke
        )

    # -- the loop -------------------------------------------------------------
    def run(self) -> None:
        """Poll and process until :meth:`stop`; then save state and leave the group."""
        try:
            while not self._stop.is_set():
                self.run_once()
        finally:
            self.close()

    def run_once(self, timeout: float | None = None) -> int:
        """One poll-process-publish cycle; returns how many records it consumed."""
        records = self._consumer.poll(
            self.max_records, self.poll_timeout_s if timeout is None else timeout
        )
        started = time.perf_counter()
        outputs = self._process(records) if records else []
        outputs += self.stage.tick(time.time())
        self._publish(outputs)
        if records:
            observe_ignored(self.metrics, self.stage)
            self._producer.flush()
            self.metrics.batch_seconds.labels(self.stage.name).observe(
                time.perf_counter() - started
            )
        if self._store is None:
            if records:
                self._consumer.commit()
        elif records and time.monotonic() - self._last_snapshot >= self.snapshot_interval_s:
            self.checkpoint()
        return len(records)

    def drain(self) -> list[Output]:
        """End of input: let the stage emit what it still holds, and publish it."""
        outputs = self.stage.flush()
        self._publish(outputs)
        self._producer.flush()
        return outputs

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        try:
            self._producer.flush()
            if self._store is not None:
                self.checkpoint()
            else:
                self._consumer.commit()
        except Exception:  # closing must not hide the error that stopped the loop
            log.exception("%s: could not save state on close", self.group)
        self._consumer.close()
        self._producer.close()

    # -- processing -----------------------------------------------------------
    def _process(self, records: list[Record]) -> list[Output]:
        items, sources = self._decode(records)
        self._track(records, sources, items)
        if not items:
            return []
        # The batch is a transaction on the state of its runs: a failure puts
        # them back as they were, so the retry below counts nothing twice.
        run_ids = set(map(_RUN_ID, map(_EVENT, items)))
        before = self.stage.snapshot(run_ids)
        try:
            return self.stage.handle_batch(items)
        except Exception:
            log.exception("%s: batch failed; retrying record by record", self.group)
        self._rewind(run_ids, before)
        # A failing batch is retried one record at a time so that only the
        # record that fails goes to the DLQ, with its own reason (and none of its effects).
        outputs: list[Output] = []
        for item, record in zip(items, sources):
            run_ids = {item[1].run_id}  # type: ignore[attr-defined]
            before = self.stage.snapshot(run_ids)
            try:
                outputs += self.stage.handle_batch([item])
            except Exception as exc:
                log.exception("%s: record %s[%d]@%d failed", self.group, record.topic,
                              record.partition, record.offset)
                self._rewind(run_ids, before)
                self._to_dlq(record, exc)
        return outputs

    def _rewind(self, run_ids: set[str], before: dict) -> None:
        """Put these runs' state back to ``before`` (runs it lacks did not exist yet)."""
        self.stage.forget(run_ids - before.keys())
        self.stage.restore(before)

    # A step crosses ~8 worker hops in a backtest, so the per-record work here
    # is kept to what needs Python; the rest goes through map/zip (C speed).
    def _decode(self, records: list[Record]) -> tuple[list[tuple[str, BaseModel]], list[Record]]:
        """The ``(topic, event)`` pairs and their records; the undecodable go to the DLQ."""
        items, sources = self._decode_all(records)
        if self._admit is None:
            return items, sources
        # A stage may refuse decodable records (unauthenticated or replayed steps, bad run settings):
        # they go to the DLQ with the stage's reason, before any state sees them.
        kept: list[tuple[str, BaseModel]] = []
        kept_sources: list[Record] = []
        for item, record in zip(items, sources):
            try:
                self._admit(*item)
            except RecordRejected as exc:
                self._to_dlq(record, exc)
                continue
            kept.append(item)
            kept_sources.append(record)
        return kept, kept_sources

    def _decode_all(self, records: list[Record]) -> tuple[list[tuple[str, BaseModel]], list[Record]]:
        if len(self._models) == 1:  # every stage but the actuator
            ((topic, model),) = self._models.items()
            events = [record.cached(model) for record in records]
            if all(map(_IS_NOT_NONE, events)):  # all decoded already (the embedded bus)
                return list(zip(repeat(topic), events)), records
        items: list[tuple[str, BaseModel]] = []
        sources: list[Record] = []
        for record in records:
            try:
                event = record.decoded(self._models[record.topic])
            except SchemaError as exc:
                self._to_dlq(record, exc)
                continue
            items.append((record.topic, event))
            sources.append(record)
        return items, sources

    def _track(
        self, records: list[Record], sources: list[Record], items: list[tuple[str, BaseModel]]
    ) -> None:
        """Positions, runs per partition and input metrics of one polled batch."""
        if self._store is not None:  # positions and dirty partitions serve snapshots only
            # A batch holds each partition's records in offset order: the last wins.
            last = dict(zip(map(_TOPIC_PARTITION, records), map(_OFFSET, records)))
            for tp, offset in last.items():
                self._positions[tp] = offset + 1
            self._dirty.update(map(_PARTITION, sources))
        # Which runs each partition holds (to forget them when it moves away).
        partitions = set(map(_PARTITION, sources))
        if len(partitions) == 1:
            self._partition_runs[partitions.pop()].update(map(_RUN_ID, map(_EVENT, items)))
        else:
            for partition, run_id in zip(map(_PARTITION, sources), map(_RUN_ID, map(_EVENT, items))):
                self._partition_runs[partition].add(run_id)
        # Counted per batch, not per record: label look-ups cost a microsecond each.
        name = self.stage.name
        topics = Counter(map(_TOPIC, records)) if len(self._models) > 1 else {
            records[0].topic: len(records)
        }
        for topic, count in topics.items():
            self.metrics.records_in.labels(name, topic).inc(count)
        # No timestamp is 0 (the usual case): the plain minimum is the oldest.
        oldest = min(map(_TIMESTAMP, records))
        if not oldest:
            oldest = min((r.timestamp_ms for r in records if r.timestamp_ms), default=0)
        if oldest:
            self.metrics.lag_seconds.labels(name).observe(max(0.0, time.time() - oldest / 1000))
        if self._reads_steps_or_acks:
            observe_inputs(self.metrics, items)

    def _publish(self, outputs: list[Output]) -> None:
        if not outputs:
            return
        self._producer.publish_events(outputs)
        for topic, count in Counter(map(_TOPIC_OF_OUTPUT, outputs)).items():
            self.metrics.records_out.labels(self.stage.name, topic).inc(count)
        observe_outputs(self.metrics, outputs)

    def _to_dlq(self, record: Record, exc: BaseException) -> None:
        letter = dead_letter(record, exc, self.group)
        log.warning("%s: %s[%d]@%d to the DLQ: %s", self.group, record.topic, record.partition,
                    record.offset, letter.reason)
        self._producer.publish(self.dlq_topic, encode(letter), key=record.key)
        self.metrics.dead_letters.labels(self.stage.name, letter.error).inc()

    # -- state ----------------------------------------------------------------
    def checkpoint(self) -> None:
        """Snapshot the state of every partition touched since the last one, then commit."""
        if self._store is not None:
            for partition in sorted(self._dirty):
                offsets = {
                    topic: self._positions[(topic, partition)]
                    for topic in self._models
                    if (topic, partition) in self._positions
                }
                runs = self.stage.snapshot(self._partition_runs[partition])
                self._store.save(self._producer, partition, offsets, runs)
            self._producer.flush()
        self._dirty.clear()
        self._consumer.commit()
        self._last_snapshot = time.monotonic()

    def _on_assign(self, gained: set[tuple[str, int]]) -> None:
        if self._store is None:
            return
        self._store.invalidate()  # the previous owner may have written since we read it
        for partition in sorted({p for _, p in gained}):
            snapshot = self._store.load(partition)
            if not snapshot:
                continue
            try:
                self.stage.restore(snapshot["runs"])
            except (SpikeguardError, ValueError, KeyError, TypeError) as exc:
                # A state this code cannot adopt (another layout version, say): the
                # partition starts afresh from the committed offsets, said and counted.
                self.stage.forget(snapshot["runs"])
                self.metrics.unreadable_snapshots.labels(self.stage.name).inc()
                log.warning("%s: cannot restore partition %d (%s: %s); it starts afresh",
                            self.group, partition, type(exc).__name__, exc)
                continue
            self._partition_runs[partition] = set(snapshot["runs"])
            for topic, offset in snapshot["offsets"].items():
                if (topic, partition) in gained:
                    self._consumer.seek(topic, partition, offset)
                    self._positions[(topic, partition)] = offset
            log.info("%s: restored partition %d (%d runs)", self.group, partition,
                     len(snapshot["runs"]))

    def _on_revoke(self, lost: set[tuple[str, int]]) -> None:
        # Save what we have before the partitions move, then let go of their runs.
        if self._store is not None and self._dirty:
            try:
                self.checkpoint()
            except Exception:
                log.exception("%s: snapshot on revoke failed", self.group)
        for partition in {p for _, p in lost}:
            self.stage.forget(self._partition_runs.pop(partition, set()))
            self._dirty.discard(partition)
