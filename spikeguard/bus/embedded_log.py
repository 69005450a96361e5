"""One partition's records in memory, with absolute offsets that survive trimming.

The embedded bus holds a partition as a :class:`PartitionLog` (a list whose
first element is at ``beginning``) or, for a compacted topic, a
:class:`CompactedLog` (the newest record of each key, by offset). Offsets
are never reused: trimming moves ``beginning`` forward, as Kafka's log start
offset does when segments are deleted, and ``end`` only ever grows.
"""

from __future__ import annotations

from spikeguard.bus.base import Record


class PartitionLog:
    """An append-only partition; the oldest records can be dropped (retention)."""

    __slots__ = ("records", "beginning")
    compacted = False

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.beginning = 0  # offset of records[0]: the log start offset

    @property
    def end(self) -> int:
        """The offset the next record gets (Kafka's log end offset)."""
        return self.beginning + len(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def append(self, record: Record) -> None:
        self.records.append(record)

    def read(self, position: int, limit: int) -> list[Record]:
        """Up to ``limit`` records from ``position`` (>= ``beginning``) on."""
        start = position - self.beginning
        return self.records[start : start + limit]

    def held(self) -> list[Record]:
        return list(self.records)

    def trim(self, before: int) -> int:
        """Drop every record below offset ``before``; how many went."""
        count = min(before, self.end) - self.beginning
        if count <= 0:
            return 0
        # One slice deletion per call: callers trim in chunks, so the cost of
        # moving the survivors is spread over many appends.
        del self.records[:count]
        self.beginning += count
        return count


class CompactedLog:
    """The newest record of each key, in offset order; older ones leave no trace.

    A dict keeps insertion (= offset) order, so a replaced record is simply
    removed and the memory a compacted topic holds is one record per live key,
    however many times each was rewritten.
    """

    __slots__ = ("by_offset", "latest", "end", "floor")
    compacted = True

    def __init__(self) -> None:
        self.by_offset: dict[int, Record] = {}
        self.latest: dict[bytes | None, int] = {}
        self.end = 0
        self.floor = 0  # records below were deleted (delete_records): the log start

    @property
    def beginning(self) -> int:
        # The log start offset: compaction leaves gaps above it (a read from a
        # gap gets the next record), only deletion moves it.
        return self.floor

    def __len__(self) -> int:
        return len(self.by_offset)

    def append(self, record: Record) -> None:
        previous = self.latest.get(record.key)
        if previous is not None:
            self.by_offset.pop(previous, None)
        self.latest[record.key] = record.offset
        self.by_offset[record.offset] = record
        self.end = record.offset + 1

    def read(self, position: int, limit: int) -> list[Record]:
        if position >= self.end or limit <= 0:
            return []
        batch: list[Record] = []
        for offset, record in self.by_offset.items():
            if offset >= position:
                batch.append(record)
                if len(batch) >= limit:
                    break
        return batch

    def held(self) -> list[Record]:
        return list(self.by_offset.values())

    def trim(self, before: int) -> int:
        gone = [offset for offset in self.by_offset if offset < before]
        for offset in gone:
            record = self.by_offset.pop(offset)
            if self.latest.get(record.key) == offset:
                del self.latest[record.key]
        self.floor = max(self.floor, min(before, self.end))
        return len(gone)
