"""The Kafka engine's producer: idempotent, one request per partition per flushed batch.

Kept apart from :mod:`spikeguard.bus.kafka` (the bus, its consumer and admin
calls) so that each stays one idea; :meth:`KafkaBus.producer` builds it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kafka import KafkaProducer
from kafka.errors import KafkaError
from kafka.partitioner.default import murmur2

from spikeguard.bus.base import Headers, Producer, as_key
from spikeguard.errors import DeliveryError

__all__ = ["KafkaBusProducer"]


class KafkaBusProducer(Producer):
    """Idempotent producer; ``flush`` reports every send that failed.

    Every spikeguard caller flushes at the end of its batch, so records wait
    in kafka-python's accumulator until then (``linger_ms`` only bounds the
    wait of records nobody flushes): a batch goes out as one request per
    partition, and the sender thread is woken once per partition batch, not
    every few records as a short linger does while a worker is still
    publishing (each wake-up costs the publishing thread a socket write).
    """

    def __init__(self, config: dict[str, Any], max_request_size: int = 1024 * 1024,
                 linger_ms: int = 500, batch_size: int = 256 * 1024):
        self._producer = KafkaProducer(**config, enable_idempotence=True, acks="all", linger_ms=linger_ms,
                                       batch_size=batch_size, max_request_size=max_request_size)
        self._pending: list[tuple[str, Any]] = []
        self._lock = threading.Lock()
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
            found = self._partitions[(topic, key)] = partitions[(murmur2(key) & 0x7FFFFFFF) % len(partitions)]
        return found

    def publish(self, topic: str, value: bytes, key: str | bytes | None = None, headers: Headers | None = None) -> None:
        key = as_key(key)
        try:
            future = self._producer.send(
                topic, value=value, key=key, partition=self._partition(topic, key),
                headers=[(k, bytes(v)) for k, v in headers] if headers else None,
            )
        except KafkaError as exc:
            raise DeliveryError(f"could not publish to topic {topic!r}: {exc!r}") from exc
        with self._lock:
            self._pending.append((topic, future))

    def flush(self, timeout: float | None = None) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._producer.flush(timeout=timeout)
        except KafkaError:
            pass  # the futures below say which records are missing
        self._partitions.clear()
        # The usual case, every record acknowledged, is read off the futures' fields;
        # only the others are waited on (get() builds each record's metadata).
        pending = [(topic, future) for topic, future in pending
                   if not future.is_done or future.exception is not None]
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
            detail = "; ".join(f"topic {t!r}: {n} record(s), first error {why}" for t, (n, why) in failed.items())
            raise DeliveryError(f"the broker did not acknowledge {detail}")

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._producer.close()
