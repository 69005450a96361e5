"""The in-process bus: topics, partitions, consumer groups, all in one process.

It is the engine spikeguard runs on by default, not a test double: the same
delivery rules as Kafka (per-key order within a partition, committed group
offsets, partitions split among a group's members), thread-safe, with an
optional directory that records every topic so a run can be replayed later.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Iterable

from pydantic import BaseModel

from spikeguard.bus.base import (
    Bus,
    Consumer,
    Headers,
    Producer,
    RebalanceCallback,
    Record,
    TopicPartition,
    as_key,
    partition_for,
)
from spikeguard.bus.recording import Recording


class _Topic:
    def __init__(self, name: str, partitions: int, compacted: bool) -> None:
        self.name = name
        # A compacted topic replaces an older record of the same key by None,
        # so memory stays bounded for state snapshots; offsets never move.
        self.logs: list[list[Record | None]] = [[] for _ in range(partitions)]
        self.compacted = compacted
        self.latest: dict[tuple[int, bytes | None], int] = {}


class _Group:
    def __init__(self) -> None:
        self.members: dict[int, "EmbeddedConsumer"] = {}
        self.committed: dict[TopicPartition, int] = {}
        self.generation = 0


class EmbeddedBus(Bus):
    """In-process topics. ``data_dir`` records every record (and group offsets) to disk."""

    engine = "embedded"

    def __init__(self, partitions: int = 4, data_dir: str | os.PathLike | None = None) -> None:
        # Set by open_runtime: the key of the in-process pipeline this bus carries, so a
        # Guard handed the bus directly signs its steps as that pipeline requires.
        self.signing_key = None
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self.partitions = partitions
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self._cond = threading.Condition()
        self._topics: dict[str, _Topic] = {}
        self._groups: dict[str, _Group] = {}
        self._member_ids = itertools.count()
        self._recording = Recording(self.data_dir) if self.data_dir is not None else None
        if self._recording is not None:
            with self._cond:
                self._load(self._recording)

    # -- topics ---------------------------------------------------------------
    def create_topics(self, topics: Iterable[str], *, compacted: bool = False) -> None:
        with self._cond:
            for name in topics:
                self._topic(name, compacted)

    def _topic(self, name: str, compacted: bool = False) -> _Topic:
        topic = self._topics.get(name)
        if topic is None:
            if not name or "/" in name or name.startswith("_"):
                raise ValueError(f"invalid topic name {name!r}")
            topic = self._topics[name] = _Topic(name, self.partitions, compacted)
            self._cond.notify_all()  # consumers waiting on a missing topic re-check
            for group in self._groups.values():
                group.generation += 1
        return topic

    def topics(self) -> list[str]:
        with self._cond:
            return sorted(self._topics)

    def _append(
        self,
        items: Iterable[tuple[str, bytes | None, bytes | None, Headers, object | None]],
    ) -> None:
        """Append (topic, key, value, headers, event) records under one lock."""
        now_ms = int(time.time() * 1000)
        partitions = self.partitions
        recording = self._recording
        with self._cond:
            topics = self._topics
            for topic_name, key, value, headers, event in items:
                topic = topics.get(topic_name) or self._topic(topic_name)
                # One partition: every key maps to 0, no need to hash it.
                partition = partition_for(key, partitions) if partitions > 1 else 0
                log = topic.logs[partition]
                record = Record(
                    topic_name,
                    partition,
                    len(log),
                    key,
                    value,
                    tuple((str(k), bytes(v)) for k, v in headers) if headers else (),
                    now_ms,
                    event=event,
                )
                if topic.compacted:
                    previous = topic.latest.get((partition, key))
                    if previous is not None:
                        log[previous] = None
                    topic.latest[(partition, key)] = record.offset
                log.append(record)
                if recording is not None:
                    recording.append(record)
            self._cond.notify_all()

    def read_all(self, topic: str, timeout: float = 10.0) -> list[Record]:
        with self._cond:
            found = self._topics.get(topic)
            if found is None:
                return []
            return [r for log in found.logs for r in log if r is not None]

    # -- clients --------------------------------------------------------------
    def producer(self) -> Producer:
        return EmbeddedProducer(self)

    def consumer(
        self,
        group: str,
        topics: Iterable[str],
        *,
        from_beginning: bool = True,
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
    ) -> "EmbeddedConsumer":
        return EmbeddedConsumer(self, group, list(topics), from_beginning, on_assign, on_revoke)

    def close(self) -> None:
        with self._cond:
            if self._recording is not None:
                self._recording.close()

    def _load(self, recording: Recording) -> None:
        topics, groups = recording.load(self.partitions)
        for name, logs in topics.items():
            topic = self._topic(name)
            for partition, stored in enumerate(logs):
                topic.logs[partition] = [
                    Record(name, partition, offset, key, value, headers, timestamp)
                    for offset, (key, value, headers, timestamp) in enumerate(stored)
                ]
        for name, committed in groups.items():
            self._groups.setdefault(name, _Group()).committed.update(committed)

    # -- groups (called under self._cond) -------------------------------------
    def _join(self, consumer: "EmbeddedConsumer") -> int:
        member = next(self._member_ids)
        group = self._groups.setdefault(consumer.group, _Group())
        group.members[member] = consumer
        group.generation += 1
        self._cond.notify_all()
        return member

    def _leave(self, consumer: "EmbeddedConsumer") -> None:
        group = self._groups.get(consumer.group)
        if group and group.members.pop(consumer.member, None) is not None:
            group.generation += 1
            self._cond.notify_all()

    def _assignment(self, group_name: str, member: int) -> set[TopicPartition]:
        """Range-style assignment: each topic's partitions split over its subscribers."""
        group = self._groups[group_name]
        mine: set[TopicPartition] = set()
        subscribed = sorted({t for c in group.members.values() for t in c.topics})
        for topic in subscribed:
            if topic not in self._topics:
                continue
            members = sorted(m for m, c in group.members.items() if topic in c.topics)
            for partition in range(self.partitions):
                if members[partition % len(members)] == member:
                    mine.add((topic, partition))
        return mine

# A run's key as bytes, one shared object per run rather than one per record
# (the bus keeps every record; bytes are immutable, so sharing is safe).
_run_key = lru_cache(maxsize=4096)(str.encode)


class EmbeddedProducer(Producer):
    def __init__(self, bus: EmbeddedBus) -> None:
        self._bus = bus

    def publish(
        self,
        topic: str,
        value: bytes,
        key: str | bytes | None = None,
        headers: Headers | None = None,
    ) -> None:
        if value is None:  # a tombstone: a compacted topic forgets the key
            if key is None:
                raise TypeError("a tombstone (value None) needs a key")
        elif not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"value must be bytes, got {type(value).__name__}")
        else:
            value = bytes(value)
        self._bus._append([(topic, as_key(key), value, headers or (), None)])

    def publish_events(self, events: Iterable[tuple[str, BaseModel]]) -> None:
        # The event object travels as is (it is frozen); its bytes are made
        # only if somebody reads them (persistence, a DLQ letter, a test).
        self._bus._append(
            (topic, _run_key(event.run_id), None, (), event)  # type: ignore[attr-defined]
            for topic, event in events
        )

    def flush(self, timeout: float | None = None) -> None:
        # Appends are synchronous: acknowledged once publish returns.
        bus = self._bus
        if bus._recording is not None:
            with bus._cond:
                bus._recording.flush()

    def close(self) -> None:
        self.flush()


class EmbeddedConsumer(Consumer):
    def __init__(
        self,
        bus: EmbeddedBus,
        group: str,
        topics: list[str],
        from_beginning: bool,
        on_assign: RebalanceCallback | None,
        on_revoke: RebalanceCallback | None,
    ) -> None:
        if not group:
            raise ValueError("a consumer needs a group name")
        self._bus = bus
        self.group = group
        self.topics = topics
        self._from_beginning = from_beginning
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._owned: set[TopicPartition] = set()
        self._positions: dict[TopicPartition, int] = {}
        self._generation = -1
        self._next = 0  # round-robin start, so one busy partition cannot starve the others
        self._closed = False
        with bus._cond:
            self.member = bus._join(self)

    def _rebalance(self) -> None:
        """Adopt the group's current assignment (callbacks run outside the lock)."""
        bus = self._bus
        while True:
            with bus._cond:
                group = bus._groups[self.group]
                if self._generation == group.generation:
                    return
                self._generation = group.generation
                wanted = bus._assignment(self.group, self.member)
                lost = self._owned - wanted
                gained = wanted - self._owned
                self._owned = wanted
                for tp in lost:
                    self._positions.pop(tp, None)
                for tp in gained:
                    start = group.committed.get(tp)
                    if start is None:
                        start = 0 if self._from_beginning else len(bus._topics[tp[0]].logs[tp[1]])
                    self._positions[tp] = start
            if lost and self._on_revoke:
                self._on_revoke(lost)
            if gained and self._on_assign:
                self._on_assign(gained)

    def poll(self, max_records: int = 500, timeout: float = 1.0) -> list[Record]:
        if self._closed:
            raise RuntimeError("poll on a closed consumer")
        deadline = time.monotonic() + max(0.0, timeout)
        bus = self._bus
        while True:
            self._rebalance()
            with bus._cond:
                if self._generation == bus._groups[self.group].generation:
                    batch = self._take(max_records)
                    if batch:
                        return batch
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return []
                    bus._cond.wait(remaining)

    def _take(self, max_records: int) -> list[Record]:
        owned = sorted(self._owned)
        batch: list[Record] = []
        if not owned:
            return batch
        start = self._next % len(owned)
        self._next += 1
        for tp in owned[start:] + owned[:start]:
            topic = self._bus._topics[tp[0]]
            log = topic.logs[tp[1]]
            position = self._positions[tp]
            if topic.compacted:  # may hold None (replaced records): skip them
                while position < len(log) and len(batch) < max_records:
                    record = log[position]
                    position += 1
                    if record is not None:
                        batch.append(record)
            else:  # no holes: one slice
                chunk = log[position : position + max_records - len(batch)]
                batch += chunk
                position += len(chunk)
            self._positions[tp] = position
            if len(batch) >= max_records:
                break
        return batch

    def commit(self) -> None:
        bus = self._bus
        with bus._cond:
            group = bus._groups[self.group]
            current = bus._assignment(self.group, self.member)
            # Only partitions this member still owns: after a rebalance the new
            # owner's progress must not be overwritten by a stale member.
            for tp in self._owned & current:
                group.committed[tp] = self._positions[tp]
            if bus._recording is not None:
                bus._recording.save_offsets(self.group, group.committed)

    def assignment(self) -> set[TopicPartition]:
        self._rebalance()
        return set(self._owned)

    def seek(self, topic: str, partition: int, offset: int) -> None:
        tp = (topic, partition)
        if tp not in self._owned:
            raise ValueError(f"seek on {topic}[{partition}], which this consumer does not own")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        self._positions[tp] = offset

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._bus._cond:
            self._bus._leave(self)
        # A closed consumer never rebalances again; dropping the callbacks
        # (usually bound methods of its worker, which holds this consumer)
        # breaks the cycle, so the bus and its records are freed by reference
        # counting instead of waiting for a full, slow GC pass.
        self._on_assign = self._on_revoke = None
