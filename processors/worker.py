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
from typing import TypeVar

from pydantic import BaseModel

from spikeguard.bus import Bus, Record
from spikeguard.deadletters import dead_letter
from spikeguard.errors import SchemaError
from spikeguard.metrics import Metrics, default_metrics, observe_inputs, observe_outputs
from spikeguard.processors.stage import Output, Stage
from spikeguard.processors.state_store import StateStore
from spikeguard.schemas import decode, encode

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def decode_record(record: Record, model: type[M]) -> M:
    """The record's event, decoded once per process however many stages read it."""
    cached = record.cache.get(model)
    if cached is None:
        cached = record.cache[model] = decode(record.value, model)  # type: ignore[arg-type]
    return cached


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
        self._store = StateStore(bus, topics.state(stage.name)) if snapshots else None
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
        items: list[tuple[str, BaseModel]] = []
        sources: list[Record] = []
        per_topic: Counter[str] = Counter()
        for record in records:
            self._positions[(record.topic, record.partition)] = record.offset + 1
            per_topic[record.topic] += 1
            try:
                event = decode_record(record, self._models[record.topic])
            except SchemaError as exc:
                self._to_dlq(record, exc)
                continue
            self._partition_runs[record.partition].add(event.run_id)  # type: ignore[attr-defined]
            self._dirty.add(record.partition)
            items.append((record.topic, event))
            sources.append(record)
        self._observe_inputs(records, per_topic, items)
        if not items:
            return []
        try:
            return self.stage.handle_batch(items)
        except Exception:
            log.exception("%s: batch failed; retrying record by record", self.group)
        # A failing batch is retried one record at a time so that only the
        # record that fails goes to the DLQ, with its own reason.
        outputs: list[Output] = []
        for item, record in zip(items, sources):
            try:
                outputs += self.stage.handle_batch([item])
            except Exception as exc:
                log.exception("%s: record %s[%d]@%d failed", self.group, record.topic,
                              record.partition, record.offset)
                self._to_dlq(record, exc)
        return outputs

    def _publish(self, outputs: list[Output]) -> None:
        if not outputs:
            return
        self._producer.publish_events(outputs)
        per_topic = Counter(topic for topic, _ in outputs)
        for topic, count in per_topic.items():
            self.metrics.records_out.labels(self.stage.name, topic).inc(count)
        observe_outputs(self.metrics, outputs)

    def _observe_inputs(
        self, records: list[Record], per_topic: Counter[str], items: list[tuple[str, BaseModel]]
    ) -> None:
        # Counted per batch, not per record: label look-ups cost a microsecond each.
        name = self.stage.name
        for topic, count in per_topic.items():
            self.metrics.records_in.labels(name, topic).inc(count)
        oldest = min((r.timestamp_ms for r in records if r.timestamp_ms), default=0)
        if oldest:
            self.metrics.lag_seconds.labels(name).observe(max(0.0, time.time() - oldest / 1000))
        observe_inputs(self.metrics, items)

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
            self.stage.restore(snapshot["runs"])
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
