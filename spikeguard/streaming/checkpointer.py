"""What a worker saves, and when: per-run state, input positions, tombstones.

The worker loop tells it what each batch read and which runs it changed;
at a checkpoint it writes only those runs, then each touched partition's
positions (see :mod:`spikeguard.streaming.state_store` for the layout), and
after the group commit the tombstones of runs that ended. On assignment it
restores a partition's runs, seeks its inputs, and names the records a run
saved ahead of its partition already holds, so they are not learnt twice.

A checkpoint may cover only some partitions (:meth:`Checkpointer.due`): each
partition is saved on its own schedule, one at a time, and committed at the
very positions its saved state includes, never further. Saving every
partition at once stalled the loop for the whole save (hundreds of
milliseconds for a hundred runs), which was the pipeline's p99 latency.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from operator import attrgetter
from typing import Iterable

from spikeguard.bus import Consumer, Producer, Record
from spikeguard.bus.base import TopicPartition
from spikeguard.errors import SpikeguardError
from spikeguard.streaming.stage import Stage
from spikeguard.streaming.state_store import StateStore

log = logging.getLogger(__name__)

_TOPIC_PARTITION = attrgetter("topic", "partition")
_OFFSET = attrgetter("offset")


class Checkpointer:
    def __init__(
        self,
        store: StateStore,
        stage: Stage,
        topics: Iterable[str],
        group: str,
        on_unadoptable=None,
    ) -> None:  # type: ignore[no-untyped-def]
        self.store = store
        self.stage = stage
        self.topics = list(topics)
        self.group = group
        self._on_unadoptable = on_unadoptable
        self.positions: dict[TopicPartition, int] = {}
        self._dirty_partitions: set[int] = set()
        self._dirty_runs: set[str] = set()
        self._tombstones: dict[str, None] = {}
        # Runs with a live record on the state topic: only they need a tombstone (a new
        # group reads every past run's end on the compacted runs topic).
        self._stored: set[str] = set()
        # (topic, partition) -> run_id -> first offset not yet in that run's restored state.
        self._skip: dict[TopicPartition, dict[str, int]] = {}
        self._legacy: set[int] = set()
        # partition -> when it was last saved (or first had something to save): the oldest goes first.
        self._saved_at: dict[int, float] = {}
        # Ended runs' partitions: a run is tombstoned once its partition is committed past its end.
        self._ended_in: dict[str, int | None] = {}

    # -- what a batch did -----------------------------------------------------
    def advance(self, records: list[Record]) -> None:
        """The consumer read these records: its positions moved."""
        # A batch holds each partition's records in offset order: the last wins.
        last = dict(zip(map(_TOPIC_PARTITION, records), map(_OFFSET, records)))
        for tp, offset in last.items():
            self.positions[tp] = offset + 1
            self._dirty_partitions.add(tp[1])

    def unseen(self, records: list[Record]) -> list[Record]:
        """``records`` without those a restored run's state already includes."""
        if not self._skip:
            return records
        kept = []
        for record in records:
            runs = self._skip.get((record.topic, record.partition))
            if runs is not None:
                until = runs.get(record.key_text)  # type: ignore[arg-type]
                if until is not None and record.offset < until:
                    continue
            kept.append(record)
        for tp in [
            tp for tp, runs in self._skip.items() if self.positions.get(tp, 0) >= max(runs.values())
        ]:
            del self._skip[tp]
        return kept

    def changed(self, run_ids: Iterable[str]) -> None:
        self._dirty_runs.update(run_ids)

    def ended(self, run_ids: Iterable[str], partitions: dict[str, int] | None = None) -> None:
        """These runs are gone: their records are tombstoned once their partition is committed.

        ``partitions``: run_id -> its input partition (a run of unknown partition waits
        for a checkpoint of every partition).
        """
        for run_id in run_ids:
            self._dirty_runs.discard(run_id)
            self._tombstones[run_id] = None
            partition = self._ended_in[run_id] = (
                None if partitions is None else partitions.get(run_id)
            )
            if partition is not None:  # so that its partition comes due, and the tombstone goes out
                self._dirty_partitions.add(partition)

    def due(self, now: float, interval_s: float, run_partition: dict[str, int]) -> list[int]:
        """The partitions to save now: the one saved longest ago, if that is ``interval_s`` ago.

        One per call, so a save costs the loop one partition's runs, not every partition's;
        a partition overdue by twice the interval (a loop too slow to save one per batch)
        is saved along with it. Empty when nothing is due.
        """
        waiting = set(self._dirty_partitions)
        for run_id in self._dirty_runs:
            partition = run_partition.get(run_id)
            if partition is not None:
                waiting.add(partition)
        if not waiting:
            return []
        saved_at = self._saved_at
        for partition in waiting:
            saved_at.setdefault(partition, now)  # first dirty now: due an interval from now
        oldest = sorted(waiting, key=saved_at.__getitem__)
        if now - saved_at[oldest[0]] < interval_s:
            return []
        return [oldest[0]] + [p for p in oldest[1:] if now - saved_at[p] >= 2 * interval_s]

    @property
    def pending(self) -> bool:
        return bool(self._dirty_partitions or self._dirty_runs or self._tombstones)

    # -- saving -----------------------------------------------------------------
    def save(
        self,
        producer: Producer,
        run_partition: dict[str, int],
        partitions: Iterable[int] | None = None,
        now: float = 0.0,
    ) -> dict[TopicPartition, int]:
        """Write the changed runs, then the touched partitions' positions (the caller flushes).

        ``partitions``: only these (None: every partition with something to save).
        Returns the positions saved, by input topic and partition: what may be committed.
        """
        by_partition: dict[int, list[str]] = defaultdict(list)
        for run_id in self._dirty_runs:
            partition = run_partition.get(run_id)
            if partition is not None:
                by_partition[partition].append(run_id)
        everything = partitions is None
        chosen = self._dirty_partitions | by_partition.keys()
        if partitions is not None:
            chosen &= set(partitions)
        saved: dict[TopicPartition, int] = {}
        for partition in sorted(chosen):
            offsets = {
                topic: self.positions[(topic, partition)]
                for topic in self.topics
                if (topic, partition) in self.positions
            }
            saved.update(((topic, partition), offset) for topic, offset in offsets.items())
            runs = self.stage.snapshot(sorted(by_partition.get(partition, ())))
            refused = self.store.save(producer, partition, offsets, runs)
            self._stored.update(runs)
            self._stored.difference_update(refused)  # tombstoned already
            if partition in self._legacy:  # superseded by the record just written
                self.store.delete_legacy(producer, partition)
                self._legacy.discard(partition)
            self._saved_at[partition] = now
        if everything:
            self._dirty_partitions.clear()
            self._dirty_runs.clear()
        else:
            self._dirty_partitions -= chosen
            for partition in chosen:
                self._dirty_runs.difference_update(by_partition.get(partition, ()))
        return saved

    def tombstone(
        self, producer: Producer, alive: Iterable[str], partitions: Iterable[int] | None = None
    ) -> bool:
        """After a commit: tombstone the ended runs (not those back in memory since). True if any.

        ``partitions``: the partitions that commit covered (None: all): the runs of other
        partitions wait for their own.
        """
        if not self._tombstones:
            return False
        ended = list(self._tombstones)
        if partitions is not None:
            covered = set(partitions)
            ended = [run_id for run_id in ended if self._ended_in.get(run_id) in covered]
        back = set(alive)
        gone = [run_id for run_id in ended if run_id not in back and run_id in self._stored]
        for run_id in ended:
            del self._tombstones[run_id]
            self._ended_in.pop(run_id, None)
        self._stored.difference_update(gone)
        self.store.delete_runs(producer, gone)
        return bool(gone)

    # -- rebalancing ----------------------------------------------------------
    def assign(
        self, gained: set[TopicPartition], consumer: Consumer, run_partition: dict[str, int]
    ) -> None:
        """Restore the runs of the partitions gained and seek their inputs to match."""
        self.store.invalidate()  # the previous owner may have written since we read it
        try:
            for partition in sorted({p for _, p in gained}):
                self._assign_one(partition, gained, consumer, run_partition)
        finally:
            self.store.invalidate()  # what was read is in the stage now: free it

    def _assign_one(
        self,
        partition: int,
        gained: set[TopicPartition],
        consumer: Consumer,
        run_partition: dict[str, int],
    ) -> None:
        snapshot = self.store.load(partition)
        if not snapshot:
            return
        try:
            self.stage.restore(snapshot["runs"])
        except (SpikeguardError, ValueError, KeyError, TypeError) as exc:
            # A state this code cannot adopt (another layout version, say): the
            # partition starts afresh from the committed offsets, said and counted.
            self.stage.forget(snapshot["runs"])
            if self._on_unadoptable is not None:
                self._on_unadoptable()
            log.warning(
                "%s: cannot restore partition %d (%s: %s); it starts afresh",
                self.group,
                partition,
                type(exc).__name__,
                exc,
            )
            return
        for run_id in snapshot["runs"]:
            run_partition[run_id] = partition
        self._stored.update(snapshot["runs"])
        if self.store.has_legacy(partition):
            self._legacy.add(partition)
        for topic, offset in snapshot["offsets"].items():
            if (topic, partition) in gained:
                consumer.seek(topic, partition, offset)
                self.positions[(topic, partition)] = offset
        for run_id, offsets in self.store.ahead(partition).items():
            for topic, offset in offsets.items():
                if (topic, partition) in gained:
                    self._skip.setdefault((topic, partition), {})[run_id] = offset
        log.info(
            "%s: restored partition %d (%d runs)", self.group, partition, len(snapshot["runs"])
        )

    def revoke(self, lost: set[TopicPartition], runs: Iterable[str]) -> None:
        """These partitions (and their runs) moved away: nothing of theirs is saved by us now."""
        partitions = {p for _, p in lost}
        self._dirty_partitions -= partitions
        for partition in partitions:
            self._saved_at.pop(partition, None)
        runs = set(runs)
        self._dirty_runs -= runs
        self._stored -= runs  # the new owner tombstones them when they end
        for tp in lost:
            self._skip.pop(tp, None)
            self.positions.pop(tp, None)
