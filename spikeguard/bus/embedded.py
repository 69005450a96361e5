"""The in-process bus: topics, partitions, consumer groups, all in one process.

It is the engine spikeguard runs on by default, not a test double: the same
delivery rules as Kafka (per-key order within a partition, committed group
offsets, partitions split among a group's members, absolute offsets that
trimming never reuses), thread-safe, with an optional directory that records
every topic so a run can be replayed later.

Memory stays bounded in a long run when the bus is given a retention (a
trainer's runtime does, from settings): a partition keeps ``keep_consumed``
records behind the lowest offset its consumer groups committed, and never
more than ``max_records`` in all. A consumer that asks for a trimmed offset
resumes at the earliest record (or the end, for a group that starts at the
end), as Kafka's ``auto_offset_reset`` does. The recording, if any, keeps
everything on disk regardless.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol

from pydantic import BaseModel

from spikeguard.bus.base import (
    Bus,
    Headers,
    Producer,
    RebalanceCallback,
    Record,
    TopicPartition,
    as_key,
    partition_for,
)
from spikeguard.bus.embedded_consumer import EmbeddedConsumer
from spikeguard.bus.embedded_log import CompactedLog, PartitionLog
from spikeguard.bus.recording import Recording

__all__ = ["EmbeddedBus", "EmbeddedConsumer", "EmbeddedProducer"]

# Consumed records are dropped in chunks of at least this many, so that the
# list shift a trim costs is spread over many appends.
_MIN_TRIM = 64


class _Topic:
    def __init__(self, name: str, partitions: int, compacted: bool) -> None:
        self.name = name
        # A compacted topic keeps only the newest record per key, so memory
        # stays bounded for state snapshots; offsets never move.
        kind = CompactedLog if compacted else PartitionLog
        self.logs: list[PartitionLog | CompactedLog] = [kind() for _ in range(partitions)]
        self.compacted = compacted


class _Group:
    def __init__(self) -> None:
        self.members: dict[int, EmbeddedConsumer] = {}
        self.committed: dict[TopicPartition, int] = {}
        self.generation = 0


class PipelineLink(Protocol):
    """Where a trainer's step fields go instead of its bus (spikeguard/runtime/child.py)."""

    def ship_fields(self, topic: str, batch: list[dict], signing_key: Any) -> bool: ...


class EmbeddedBus(Bus):
    """In-process topics.

    Args:
        partitions: Of every topic.
        data_dir: Record every record (and group offsets) there, to reopen or replay.
        keep_consumed: Records a partition keeps behind the lowest offset its
            groups committed (None: keep every consumed record, the default
            for a bus made directly, e.g. by a backtest that reads it back).
        max_records: Cap on the records a partition holds, consumed or not
            (None: no cap). A group further behind loses the oldest and
            resumes at the earliest record left. Compacted topics hold one
            record per key and are not capped.
    """

    engine = "embedded"

    def __init__(
        self,
        partitions: int = 4,
        data_dir: str | os.PathLike | None = None,
        *,
        keep_consumed: int | None = None,
        max_records: int | None = None,
    ) -> None:
        # Set by a child-process pipeline (spikeguard/runtime/child.py): where the trainer's
        # step fields go instead of this bus.
        self.pipeline_link: PipelineLink | None = None
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        if keep_consumed is not None and keep_consumed < 0:
            raise ValueError(f"keep_consumed must be >= 0 or None, got {keep_consumed}")
        if max_records is not None and max_records < 1:
            raise ValueError(f"max_records must be >= 1 or None, got {max_records}")
        self.partitions = partitions
        self.keep_consumed = keep_consumed
        self.max_records = max_records
        # A capped log is cut back to max_records once it holds this many more.
        self._cap_slack = 0 if max_records is None else max(1, max_records // 8)
        self.data_dir = Path(data_dir) if data_dir is not None else None
        # One lock for everything; each consumer waits on a condition of its own
        # over it, so an append wakes only the readers of its topic: in a
        # trainer's process every needless wake-up is a GIL hand-off that the
        # training thread pays for.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._readers: dict[str, set[EmbeddedConsumer]] = {}
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
            self._wake_everyone()  # consumers waiting on a missing topic re-check
            for group in self._groups.values():
                group.generation += 1
        return topic

    def topics(self) -> list[str]:
        with self._cond:
            return sorted(self._topics)

    def _append(
        self,
        items: Iterable[tuple[str, bytes | None, bytes | None, Headers, object | None]],
        make: Callable[..., Record] = Record,
        wake: bool = True,
    ) -> None:
        """Append (topic, key, value, headers, event) records under one lock (``make`` builds each).

        ``wake`` False: readers find them at their next poll (records that no
        reader needs at once need not cost the writer's process a wake-up).
        """
        now_ms = int(time.time() * 1000)
        partitions = self.partitions
        recording = self._recording
        cap = self.max_records
        with self._cond:
            topics = self._topics
            touched: set[str] = set()
            for topic_name, key, value, headers, event in items:
                touched.add(topic_name)
                topic = topics.get(topic_name) or self._topic(topic_name)
                # One partition: every key maps to 0, no need to hash it.
                partition = partition_for(key, partitions) if partitions > 1 else 0
                log = topic.logs[partition]
                record = make(
                    topic_name,
                    partition,
                    log.end,
                    key,
                    value,
                    tuple((str(k), bytes(v)) for k, v in headers) if headers else (),
                    now_ms,
                    event=event,
                )
                log.append(record)
                if cap is not None and len(log) >= cap + self._cap_slack and not log.compacted:
                    log.trim(log.end - cap)
                if recording is not None:
                    recording.append(record)
            if self.keep_consumed is not None:
                for name in touched:
                    if not self._read_by_any_group(name):
                        for partition in range(partitions):
                            self._retain(name, partition)
            readers = self._readers if wake else {}
            for name in touched:
                for consumer in readers.get(name, ()):
                    consumer._wake.notify()

    def read_all(self, topic: str, timeout: float = 10.0) -> list[Record]:
        """Every record ``topic`` still holds (all of them without retention)."""
        with self._cond:
            found = self._topics.get(topic)
            if found is None:
                return []
            return [r for log in found.logs for r in log.held()]

    # -- offsets and retention ------------------------------------------------
    def beginning_offset(self, topic: str, partition: int) -> int:
        """The oldest offset ``topic[partition]`` can still deliver (Kafka's log start offset)."""
        with self._cond:
            return self._topic(topic).logs[partition].beginning

    def end_offset(self, topic: str, partition: int) -> int:
        """The offset the next record of ``topic[partition]`` gets."""
        with self._cond:
            return self._topic(topic).logs[partition].end

    def retained(self, topic: str) -> int:
        """How many records ``topic`` holds in memory, all partitions together."""
        with self._cond:
            found = self._topics.get(topic)
            return 0 if found is None else sum(len(log) for log in found.logs)

    def delete_records(self, topic: str, before: Mapping[int, int]) -> None:
        """Drop the records below ``before[partition]`` (as Kafka's DeleteRecords does)."""
        with self._cond:
            logs = self._topic(topic).logs
            for partition, offset in before.items():
                logs[partition].trim(offset)

    def _retain(self, topic_name: str, partition: int) -> None:
        """Drop what every group interested in the partition has committed, but ``keep_consumed``.

        Called under the lock after a commit, and after an append to a topic no
        group reads. A group with a member reading the topic but no commit yet
        holds everything; a group without members keeps holding what it has not
        committed (a worker restarting resumes there), up to the cap. A topic
        no group reads or has read (the decisions a trainer's bus receives when
        nothing in the trainer consumes them) keeps its last ``keep_consumed``
        records, what ``read_all`` and a reader who comes late still see.
        """
        keep = self.keep_consumed
        topic = self._topics.get(topic_name)
        if keep is None or topic is None or topic.compacted:
            return
        log = topic.logs[partition]
        tp = (topic_name, partition)
        floor = None
        for group in self._groups.values():
            committed = group.committed.get(tp)
            if committed is None:
                if not any(topic_name in member.topics for member in group.members.values()):
                    continue
                committed = log.beginning
            floor = committed if floor is None else min(floor, committed)
        if floor is None:
            floor = log.end
        if floor - keep - log.beginning >= max(_MIN_TRIM, keep // 4):
            log.trim(floor - keep)

    def _read_by_any_group(self, topic_name: str) -> bool:
        """Whether some group reads ``topic_name`` now or has committed an offset in it."""
        for group in self._groups.values():
            if any(topic_name in member.topics for member in group.members.values()):
                return True
            if any(tp[0] == topic_name for tp in group.committed):
                return True
        return False

    # -- clients --------------------------------------------------------------
    def producer(self) -> EmbeddedProducer:
        return EmbeddedProducer(self) if self.pipeline_link is None else _LinkedProducer(self)

    def consumer(
        self,
        group: str,
        topics: Iterable[str],
        *,
        from_beginning: bool = True,
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
    ) -> EmbeddedConsumer:
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
                log = topic.logs[partition]
                for offset, (key, value, headers, timestamp) in enumerate(stored):
                    log.append(Record(name, partition, offset, key, value, headers, timestamp))
        for name, committed in groups.items():
            self._groups.setdefault(name, _Group()).committed.update(committed)
        # A long recorded run comes back within the same bounds as a live one.
        for name, topic in self._topics.items():
            for partition, log in enumerate(topic.logs):
                if (
                    self.max_records is not None
                    and len(log) > self.max_records
                    and not log.compacted
                ):
                    log.trim(log.end - self.max_records)
                self._retain(name, partition)

    # -- groups (called under the lock) -----------------------------------------
    def _wake_everyone(self) -> None:
        """Every waiting consumer re-checks (a rebalance, a new topic)."""
        self._cond.notify_all()
        for readers in self._readers.values():
            for consumer in readers:
                consumer._wake.notify()

    # -- what a consumer reads the bus through (embedded_consumer.GroupLog) ----
    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def consumer_lag(self, group_prefix: str = "") -> dict[tuple[str, str, int], int]:
        """``(group, topic, partition) -> records not yet committed``, for groups named so."""
        found: dict[tuple[str, str, int], int] = {}
        with self._cond:  # one consistent view
            for group_name, group in self._groups.items():
                if not group_name.startswith(group_prefix):
                    continue
                topics = {t for member in group.members.values() for t in member.topics}
                topics |= {t for t, _ in group.committed}
                for topic_name in topics:
                    topic = self._topics.get(topic_name)
                    if topic is None:
                        continue
                    for partition, records in enumerate(topic.logs):
                        # Offsets are absolute (retention trims the front): end - committed.
                        done = group.committed.get((topic_name, partition), records.beginning)
                        found[(group_name, topic_name, partition)] = max(0, records.end - done)
        return found

    def generation(self, group: str) -> int:
        return self._groups[group].generation

    def committed(self, group: str, tp: TopicPartition) -> int | None:
        return self._groups[group].committed.get(tp)

    def partition(self, tp: TopicPartition) -> PartitionLog | CompactedLog:
        return self._topics[tp[0]].logs[tp[1]]

    def commit_offsets(self, group: str, offsets: Mapping[TopicPartition, int]) -> None:
        committed = self._groups[group].committed
        for tp, offset in offsets.items():
            committed[tp] = offset
            self._retain(*tp)
        if self._recording is not None:
            self._recording.save_offsets(group, committed)

    def join_group(self, consumer: EmbeddedConsumer) -> int:
        member = next(self._member_ids)
        group = self._groups.setdefault(consumer.group, _Group())
        group.members[member] = consumer
        group.generation += 1
        for topic in consumer.topics:
            self._readers.setdefault(topic, set()).add(consumer)
        self._wake_everyone()
        return member

    def leave_group(self, consumer: EmbeddedConsumer) -> None:
        for topic in consumer.topics:
            self._readers.get(topic, set()).discard(consumer)
        group = self._groups.get(consumer.group)
        if group and group.members.pop(consumer.member, None) is not None:
            group.generation += 1
            self._wake_everyone()

    def assigned(self, group_name: str, member: int) -> set[TopicPartition]:
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
        event: BaseModel | None = None,
    ) -> None:
        """``event``: the (frozen) model ``value`` encodes, handed to consumers as is.

        A trainer's publisher passes it, so the in-process detectors read the
        step without decoding its JSON again. ``value`` None is a tombstone: a
        compacted topic forgets the key.
        """
        if value is None:
            if key is None:
                raise TypeError("a tombstone (value None) needs a key")
        elif not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"value must be bytes, got {type(value).__name__}")
        else:
            value = bytes(value)
        self._bus._append([(topic, as_key(key), value, headers or (), event)])

    def publish_events(self, events: Iterable[tuple[str, BaseModel]]) -> None:
        # The event object travels as is (it is frozen); its bytes are made
        # only if somebody reads them (persistence, a DLQ letter, a test).
        self._bus._append(
            # Every event this carries is a run's (BaseModel itself declares no run_id).
            (topic, _run_key(event.run_id), None, (), event)  # type: ignore[attr-defined]
            for topic, event in events
        )

    def publish_records(
        self, records: Iterable[tuple[str, bytes | None, bytes | None, Headers, BaseModel | None]]
    ) -> None:
        """``(topic, key, value, headers, event)`` records (from another bus), under one lock:
        one wake-up of each reader per batch."""
        self._bus._append(records)

    def flush(self, timeout: float | None = None) -> None:
        # Appends are synchronous: acknowledged once publish returns.
        bus = self._bus
        if bus._recording is not None:
            with bus._cond:
                bus._recording.flush()

    def close(self) -> None:
        self.flush()


class _LinkedProducer(EmbeddedProducer):
    """A producer on the trainer's bus when the pipeline runs in a child process."""

    def ship_fields(self, topic: str, batch: list[dict], signing_key: Any) -> bool:
        """Hand the fields of step events to the pipeline as they are; False if it cannot take them.

        The background publisher asks this first: the trainer's process then
        neither builds, signs nor encodes its steps (spikeguard/runtime/child.py).
        """
        link = self._bus.pipeline_link
        return link is not None and link.ship_fields(topic, batch, signing_key)
