"""The Kafka engine's producer: idempotent, one request per partition per flushed batch.

Kept apart from :mod:`spikeguard.bus.kafka` (the bus, its consumer and admin
calls) so that each stays one idea; :meth:`KafkaBus.producer` builds it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError
from kafka.partitioner.default import murmur2

from spikeguard.bus.base import Headers, Producer, as_key, undelivered
from spikeguard.errors import DeliveryError

log = logging.getLogger(__name__)

__all__ = ["KafkaBusProducer"]


class KafkaBusProducer(Producer):
    """Idempotent producer; ``flush`` reports every send that failed.

    Every spikeguard caller flushes at the end of its batch, so records wait
    in kafka-python's accumulator until then (``linger_ms`` only bounds the
    wait of records nobody flushes): a batch goes out as one request per
    partition, and the sender thread is woken once per partition batch, not
    every few records as a short linger does while a worker is still
    publishing (each wake-up costs the publishing thread a socket write).

    :meth:`send_now` makes the queued batches ready without waiting for their
    acknowledgements: kafka-python has no public call for it, so it does the
    first half of ``KafkaProducer.flush`` (the accumulator's ``begin_flush``,
    which makes every partition's batch sendable whatever its linger, and a
    sender wake-up) and keeps the flag raised only until the sender drained the
    batches queued then. Lowered when the next batch starts publishing, not at
    once: the sender thread may not have looked yet, and lowered too early the
    batch would wait the whole linger; lowered, because while it is raised each
    record is sent as soon as the sender gets the GIL, a request per few records.
    """

    def __init__(
        self,
        config: dict[str, Any],
        max_request_size: int = 1024 * 1024,
        linger_ms: int = 500,
        batch_size: int = 256 * 1024,
    ):
        self._producer = KafkaProducer(
            **config,
            enable_idempotence=True,
            acks="all",
            linger_ms=linger_ms,
            batch_size=batch_size,
            max_request_size=max_request_size,
        )
        # (topic, future) of every record not yet known acknowledged, oldest first.
        self._pending: deque[tuple[str, Any]] = deque()
        self._lock = threading.Lock()
        self._accumulator = self._producer._accumulator  # for send_now: see the class docstring
        self._sending = False  # send_now raised the accumulator's flush flag
        self._send_now_unavailable = False  # kafka-python's internals were not as send_now needs
        self._queued: list[Any] = []  # the batches queued at the last send_now
        self._lost: list[
            tuple[str, Any]
        ] = []  # failed, seen by send_now or unacknowledged, not yet raised
        # (topic, key) -> partition, as kafka-python's default partitioner picks it; that
        # partitioner builds a set and a sorted list of the topic's partitions per record.
        # Emptied at every flush, so a topic given more partitions is seen within a batch.
        self._partitions: dict[tuple[str, bytes], int] = {}

    def _partition(self, topic: str, key: bytes | None) -> int | None:
        if key is None:
            return None  # kafka-python spreads unkeyed records itself
        found = self._partitions.get((topic, key))
        if found is None:
            partitions = sorted(self._producer.partitions_for(topic))
            found = self._partitions[(topic, key)] = partitions[
                (murmur2(key) & 0x7FFFFFFF) % len(partitions)
            ]
        return found

    def publish(
        self,
        topic: str,
        value: bytes,
        key: str | bytes | None = None,
        headers: Headers | None = None,
    ) -> None:
        key = as_key(key)
        try:
            future = self._producer.send(
                topic,
                value=value,
                key=key,
                partition=self._partition(topic, key),
                headers=[(k, bytes(v)) for k, v in headers] if headers else None,
            )
        except KafkaError as exc:
            raise DeliveryError(f"could not publish to topic {topic!r}: {exc!r}") from exc
        with self._lock:
            self._pending.append((topic, future))

    def publish_events(self, events: Any) -> None:
        # Looked at once per batch, not per record: the look costs more than a record.
        if self._sending and not self._send_now_unavailable and self._drained():
            self._lower()
        super().publish_events(events)

    def send_now(self) -> None:
        if self._send_now_unavailable:
            self.flush()
            return
        try:
            self._send_now()
        except AttributeError as exc:  # a kafka-python whose internals moved: latency, not records
            log.warning(
                "spikeguard: this kafka-python has no %s: sending without waiting is off, each "
                "batch waits for its acknowledgements as before",
                exc,
            )
            self._send_now_unavailable = True
            self.flush()

    def _send_now(self) -> None:
        with self._lock:
            self._forget_acknowledged()
            lost, self._lost = self._lost, []
        if lost:  # reported once: the worker stops on it, and flush() need not say it again
            self._raise(lost)
        if self._sending and self._drained():
            self._lower()
        self._queued = [b for b in self._accumulator._incomplete.all() if b.drained is None]
        if self._queued:
            if not self._sending:
                self._accumulator.begin_flush()
                self._sending = True
            self._producer._sender.wakeup()

    def _drained(self) -> bool:
        """The sender took (or gave up on) every batch queued at the last send_now."""
        return all(batch.drained is not None or batch.is_done for batch in self._queued)

    def _lower(self) -> None:
        self._accumulator._flushes_in_progress.decrement()
        self._sending = False

    def _forget_acknowledged(self) -> None:
        """Drop the oldest records the broker acknowledged; keep those that failed (caller locks)."""
        pending = self._pending
        # Done in order within a partition, nearly so across them: stop at the first not done.
        while pending and pending[0][1].is_done:
            topic, future = pending.popleft()
            if future.exception is not None:
                self._lost.append((topic, future))

    def unacknowledged(self) -> int:
        with self._lock:
            self._forget_acknowledged()
            return len(self._pending)

    @staticmethod
    def _raise(lost: list[tuple[str, Any]]) -> None:
        failed: dict[str, tuple[int, str]] = {}
        for topic, future in lost:
            count, first = failed.get(topic, (0, repr(future.exception)))
            failed[topic] = (count + 1, first)
        raise undelivered(failed)

    def flush(self, timeout: float | None = None) -> None:
        with self._lock:
            pending = self._lost + list(self._pending)
            self._pending, self._lost = deque(), []
        deadline = None if timeout is None else time.monotonic() + timeout
        with contextlib.suppress(KafkaError):  # the futures below say which records are missing
            self._producer.flush(timeout=timeout)
        self._partitions.clear()
        if self._sending and not self._send_now_unavailable:  # all drained: send_now's flag can go
            self._lower()
        # The usual case, every record acknowledged, is read off the futures' fields;
        # only the others are waited on (get() builds each record's metadata).
        pending = [
            (topic, future)
            for topic, future in pending
            if not future.is_done or future.exception is not None
        ]
        failed: dict[str, tuple[int, str]] = {}
        for topic, future in pending:
            # Wait on each future too: kafka-python's flush() can return while a
            # batch it split (MESSAGE_TOO_LARGE) is still being retried.
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                future.get(timeout=left)
                continue
            except Exception as exc:  # noqa: BLE001 - any failure is a lost record
                why = repr(exc)
            count, first = failed.get(topic, (0, why))
            failed[topic] = (count + 1, first)
        if failed:
            raise undelivered(failed)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._producer.close()
