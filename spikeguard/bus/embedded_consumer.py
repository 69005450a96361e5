"""A member of a consumer group on the embedded bus.

Split from embedded.py so that each module stays one idea: the bus holds
topics, groups and retention; a consumer holds its positions, adopts its
group's assignment and reads. It sees the bus only through :class:`GroupLog`,
the few calls it needs, each made holding ``log.lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Mapping, Protocol

from spikeguard.bus.base import Consumer, RebalanceCallback, Record, TopicPartition
from spikeguard.bus.embedded_log import CompactedLog, PartitionLog

logger = logging.getLogger(__name__)


class GroupLog(Protocol):
    """What a consumer needs of the bus it reads (the embedded bus is one); call holding ``lock``."""

    @property
    def lock(self) -> threading.RLock: ...

    def join_group(self, consumer: "EmbeddedConsumer") -> int:
        """Add ``consumer`` to its group; its member id."""

    def leave_group(self, consumer: "EmbeddedConsumer") -> None: ...

    def generation(self, group: str) -> int:
        """Changes whenever the group's assignment may have."""

    def assigned(self, group: str, member: int) -> set[TopicPartition]: ...

    def committed(self, group: str, tp: TopicPartition) -> int | None: ...

    def partition(self, tp: TopicPartition) -> PartitionLog | CompactedLog: ...

    def commit_offsets(self, group: str, offsets: Mapping[TopicPartition, int]) -> None:
        """Store the group's offsets (retention and the recording follow)."""


class EmbeddedConsumer(Consumer):
    def __init__(
        self,
        bus: GroupLog,
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
        self._woken = False  # wakeup() was called: the current or next poll returns at once
        # Notified by the bus when a topic it reads gets records, or its group changes.
        self._wake = threading.Condition(bus.lock)
        with bus.lock:
            self.member = bus.join_group(self)

    def _rebalance(self) -> None:
        """Adopt the group's current assignment (callbacks run outside the lock)."""
        bus = self._bus
        while True:
            with bus.lock:
                generation = bus.generation(self.group)
                if self._generation == generation:
                    return
                self._generation = generation
                wanted = bus.assigned(self.group, self.member)
                lost = self._owned - wanted
                gained = wanted - self._owned
                self._owned = wanted
                for tp in lost:
                    self._positions.pop(tp, None)
                for tp in gained:
                    start = bus.committed(self.group, tp)
                    if start is None:
                        log = bus.partition(tp)
                        start = log.beginning if self._from_beginning else log.end
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
            with bus.lock:
                if self._generation == bus.generation(self.group):
                    batch = self._take(max_records)
                    if batch or self._woken:
                        self._woken = False
                        return batch
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return []
                    self._wake.wait(remaining)

    def wakeup(self) -> None:
        """End a poll waiting in another thread (or the next poll) at once, with no records.

        So a reader can block on a long poll, woken by records, and still stop promptly.
        """
        with self._bus.lock:
            self._woken = True
            self._wake.notify_all()

    def _take(self, max_records: int) -> list[Record]:
        owned = sorted(self._owned)
        batch: list[Record] = []
        if not owned:
            return batch
        start = self._next % len(owned)
        self._next += 1
        for tp in owned[start:] + owned[:start]:
            log = self._bus.partition(tp)
            position = self._positions[tp]
            if position < log.beginning:
                position = self._out_of_range(tp, position, log.beginning, log.end)
            chunk = log.read(position, max_records - len(batch))
            if chunk:
                batch += chunk
                position = chunk[-1].offset + 1
            self._positions[tp] = position
            if len(batch) >= max_records:
                break
        return batch

    def _out_of_range(self, tp: TopicPartition, position: int, beginning: int, end: int) -> int:
        """Where to read from when ``position`` was trimmed: Kafka's ``auto_offset_reset``."""
        resume = beginning if self._from_beginning else end
        logger.warning(
            "spikeguard: group %r asked for offset %d of %s[%d], which retention dropped "
            "(log start %d); resuming at the %s, offset %d",
            self.group,
            position,
            tp[0],
            tp[1],
            beginning,
            "earliest" if self._from_beginning else "latest",
            resume,
        )
        return resume

    def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        bus = self._bus
        with bus.lock:
            # Only partitions this member still owns: after a rebalance the new
            # owner's progress must not be overwritten by a stale member.
            owned = self._owned & bus.assigned(self.group, self.member)
            source = self._positions if offsets is None else offsets
            bus.commit_offsets(self.group, {tp: source[tp] for tp in owned if tp in source})

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
        with self._bus.lock:
            self._bus.leave_group(self)
        # A closed consumer never rebalances again; dropping the callbacks
        # (usually bound methods of its worker, which holds this consumer)
        # breaks the cycle, so the bus and its records are freed by reference
        # counting instead of waiting for a full, slow GC pass.
        self._on_assign = self._on_revoke = None
