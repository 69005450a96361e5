"""The one seam between spikeguard and its transport.

Producers publish bytes with a key and headers; consumers join a group,
poll batches and commit what they polled. Detectors, fusion and policy never
see which engine runs them: the worker loop is the only caller of this API.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, TypeVar

from spikeguard.errors import DeliveryError
from spikeguard.schemas.codec import decode, encode

if TYPE_CHECKING:
    from pydantic import BaseModel

M = TypeVar("M", bound="BaseModel")

Headers = Sequence[tuple[str, bytes]]


class Record:
    """One message as a consumer sees it.

    ``cache`` holds decoded events, shared by every consumer of the same
    in-process record so that four detectors decode a step once. An
    in-process record published as an event (``event``) encodes its ``value``
    only when somebody asks for the bytes, and makes its ``cache`` dict only
    when somebody asks for that: a backtest keeps every record, and a dict
    each costs more than the rest of the record (:meth:`cached` reads without
    making it).
    """

    __slots__ = (
        "topic",
        "partition",
        "offset",
        "key",
        "_value",
        "headers",
        "timestamp_ms",
        "_cache",
        "_event",
    )

    def __init__(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        headers: tuple[tuple[str, bytes], ...] = (),
        timestamp_ms: int = 0,
        cache: dict | None = None,
        event: "BaseModel | None" = None,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.key = key
        self._value = value
        self.headers = headers
        self.timestamp_ms = timestamp_ms
        # Made now unless the record carries an event (then on first use, or
        # never): decoders running in several threads then share one dict.
        self._cache = {} if cache is None and event is None else cache
        self._event = event

    @property
    def cache(self) -> dict:
        """Decoded events by model (the in-process event among them)."""
        cache = self._cache
        if cache is None:
            event = self._event
            cache = self._cache = {} if event is None else {type(event): event}
        return cache

    @cache.setter
    def cache(self, cache: dict) -> None:
        self._cache = cache

    def cached(self, model: type) -> Any:
        """``cache.get(model)``, without making the cache."""
        cache = self._cache
        if cache is not None:
            return cache.get(model)
        event = self._event
        return event if type(event) is model else None

    def decoded(self, model: type[M]) -> M:
        """The record's event, decoded once per process however many readers ask.

        Raises a :class:`~spikeguard.errors.SchemaError` naming what is wrong.
        """
        found = self.cached(model)
        if found is None:
            # A null value (a tombstone) is refused by decode with a SchemaError that says so.
            found = self.cache[model] = decode(self.value, model)  # type: ignore[arg-type]
        return found

    @property
    def value(self) -> bytes | None:
        if self._value is None:
            if self._cache:
                self._value = encode(next(iter(self._cache.values())))
            elif self._cache is None and self._event is not None:
                self._value = encode(self._event)
        return self._value

    @property
    def key_text(self) -> str | None:
        return None if self.key is None else self.key.decode("utf-8", "replace")

    def _fields(self) -> tuple:
        return (self.topic, self.partition, self.offset, self.key, self.value, self.headers)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Record) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash((self.topic, self.partition, self.offset))

    def __repr__(self) -> str:
        return (
            f"Record({self.topic!r}, partition={self.partition}, offset={self.offset}, "
            f"key={self.key!r}, value={self.value!r:.80})"
        )


TopicPartition = tuple[str, int]
# Called with the partitions gained (on_assign) or about to be lost (on_revoke),
# before any record of a gained partition is returned by poll.
RebalanceCallback = Callable[[set[TopicPartition]], None]


def as_key(key: str | bytes | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


def partition_for(key: bytes | None, partitions: int, fallback: int = 0) -> int:
    """Stable key -> partition mapping (the same in every process and run)."""
    if key is None:
        return fallback % partitions
    return zlib.crc32(key) % partitions


def undelivered(failed: Mapping[str, tuple[int, str]], *more: str) -> DeliveryError:
    """The error for records the broker did not acknowledge: per topic, how many and the first error.

    ``failed`` maps a topic to (records lost, the first one's error); ``more`` adds problems
    of other kinds. Every Kafka client's ``flush`` and ``send_now`` say it the same way.
    """
    problems = [f"topic {t!r}: {n} record(s), first error {why}" for t, (n, why) in failed.items()]
    return DeliveryError(f"the broker did not acknowledge {'; '.join([*problems, *more])}")


class Producer(ABC):
    @abstractmethod
    def publish(
        self,
        topic: str,
        value: bytes,
        key: str | bytes | None = None,
        headers: Headers | None = None,
    ) -> None:
        """Queue one record. Delivery is confirmed by :meth:`flush`."""

    def publish_events(self, events: Iterable[tuple[str, "BaseModel"]]) -> None:
        """Queue ``(topic, event)`` pairs, each keyed by its ``run_id``, JSON-encoded.

        An in-process engine overrides this to hand the (immutable) event
        itself to its consumers, so they need not decode it again.
        """
        for topic, event in events:
            # Every event this carries is a run's (BaseModel itself declares no run_id).
            self.publish(topic, encode(event), key=event.run_id)  # type: ignore[attr-defined]

    @abstractmethod
    def flush(self, timeout: float | None = None) -> None:
        """Block until every queued record is acknowledged; raise DeliveryError if one was not."""

    def send_now(self) -> None:
        """Start sending every queued record now, without waiting for the broker's acknowledgements.

        A worker calls it at the end of each batch, so its outputs leave at once
        (not after the client's linger) while it goes on with the next batch;
        :meth:`flush` still says whether they were delivered. Raises
        :class:`~spikeguard.errors.DeliveryError` for a record already known lost.
        This default waits, as :meth:`flush` does (right for an engine whose
        publish is its acknowledgement).
        """
        self.flush()

    def unacknowledged(self) -> int:
        """How many published records may still be unacknowledged (0 right after :meth:`flush`).

        An upper bound (records acknowledged since the last look may still count):
        a worker flushes when it passes its limit, so the backlog stays bounded.
        """
        return 0

    def close(self) -> None:  # noqa: B027 - optional: nothing to do by default
        """Flush and release resources."""


class Consumer(ABC):
    @abstractmethod
    def poll(self, max_records: int = 500, timeout: float = 1.0) -> list[Record]:
        """Up to ``max_records`` records, waiting at most ``timeout`` seconds for the first."""

    @abstractmethod
    def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        """Commit the group's offsets: everything polled so far is done.

        ``offsets``: only these partitions, each at the given offset (the next record to
        read), e.g. the positions a state snapshot of those partitions includes; the
        other partitions' committed offsets stay where they are.
        """

    @abstractmethod
    def assignment(self) -> set[TopicPartition]:
        """The partitions this member owns right now."""

    @abstractmethod
    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read ``partition`` from ``offset`` on (used to resume from a state snapshot)."""

    def close(self) -> None:  # noqa: B027 - optional: nothing to do by default
        """Leave the group; uncommitted records go to the next owner."""


class Bus(ABC):
    """A transport: topics with partitions, keyed records, consumer groups."""

    engine: str = "?"

    @abstractmethod
    def producer(self) -> Producer: ...

    @abstractmethod
    def consumer(
        self,
        group: str,
        topics: Iterable[str],
        *,
        from_beginning: bool = True,
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
    ) -> Consumer:
        """A member of ``group`` reading ``topics``.

        A group with no committed offset starts at the beginning of each
        partition (``from_beginning``) or at its end.
        """

    @abstractmethod
    def create_topics(self, topics: Iterable[str], *, compacted: bool = False) -> None:
        """Create the topics that do not exist yet."""

    @abstractmethod
    def read_all(self, topic: str, timeout: float = 10.0) -> list[Record]:
        """Every record of ``topic`` up to its current end, outside any group."""

    @abstractmethod
    def delete_records(self, topic: str, before: "Mapping[int, int]") -> None:
        """Drop the records of each partition below ``before[partition]`` (Kafka's DeleteRecords).

        Offsets stay as they were; a consumer positioned below what is left
        resumes at the earliest record (or the end, for a group that starts there).
        """

    def close(self) -> None:  # noqa: B027 - optional: nothing to do by default
        pass

    def __enter__(self) -> "Bus":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
