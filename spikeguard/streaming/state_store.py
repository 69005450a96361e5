"""Per-run state snapshots on a compacted topic of the bus itself.

Two kinds of record, so that no record grows with the number of runs:

- ``{component}/run/{run_id}``: one run's state, the input partition it
  belongs to, and the partition's input positions the state includes
  (``{"partition": p, "offsets": {topic: n}, "state": {...}}``). Written only
  for runs that changed since the last save; a null value (a tombstone) when
  the run ended or idled out, so compaction forgets it.
- ``{component}/partition/{p}``: the positions up to which *every* run of
  partition ``p`` is saved (``{"partition": p, "offsets": {topic: n}}``),
  written after that partition's run records.

A restarted worker restores every run of a partition it gains and seeks the
inputs to the partition's positions. A run saved *after* those positions (a
crash between run records and the partition record) already holds the records
up to its own offsets: :meth:`StateStore.ahead` names them, and the worker
skips that run's records below them, so nothing is learnt twice. Offsets are
committed to the group only after the partition record is flushed, so the
committed offsets never run ahead of a snapshot.

A record larger than ``max_record_bytes`` would be refused by the broker
(Kafka's default limit is 1 MiB) and used to kill the worker: such a run's
state is not written (logged and counted, and its older record tombstoned so a
restart starts that run afresh instead of from a stale state).

Records of the older layout (key = the partition number, value = every run of
the partition with its offsets) are still read, so an upgraded worker resumes.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from pydantic_core import to_json

from spikeguard.bus import Bus, Producer

log = logging.getLogger(__name__)

#: Below Kafka's default ``max.message.bytes`` (1 MiB + 12), leaving room for the batch header.
DEFAULT_MAX_RECORD_BYTES = 1_000_000


class StateStore:
    def __init__(
        self,
        bus: Bus,
        topic: str,
        on_unreadable: Callable[[], None] | None = None,
        *,
        component: str | None = None,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        self.bus = bus
        self.topic = topic
        #: Prefix of every key: the topic's last dotted part (``state.NAME`` -> ``NAME``) by default.
        self.component = component or topic.rsplit(".", 1)[-1]
        self.max_record_bytes = max_record_bytes
        #: Snapshots that could not be read; ``on_unreadable`` is called for each (a metric).
        self.unreadable = 0
        #: Run states too large to write; ``on_refused`` is called for each (a metric).
        self.refused = 0
        self._on_unreadable = on_unreadable
        self._on_refused = on_refused
        self._run_prefix = f"{self.component}/run/"
        self._partition_prefix = f"{self.component}/partition/"
        self._loaded: _Loaded | None = None

    def ensure_topic(self) -> None:
        self.bus.create_topics([self.topic], compacted=True)

    # -- keys -----------------------------------------------------------------
    def run_key(self, run_id: str) -> str:
        return self._run_prefix + run_id

    def partition_key(self, partition: int) -> str:
        return f"{self._partition_prefix}{partition}"

    # -- reading --------------------------------------------------------------
    def load(self, partition: int) -> dict[str, Any] | None:
        """The newest snapshot of ``partition``: {"offsets": {topic: n}, "runs": {run_id: state}}.

        ``offsets`` is empty when no partition record was written yet (a crash
        during the partition's first save): its runs are then restored and
        their records up to :meth:`ahead` skipped.
        """
        loaded = self._read()
        runs = {run: state for run, (p, _, state) in loaded.runs.items() if p == partition}
        offsets = self._positions(loaded, partition)
        legacy = loaded.legacy.get(partition)
        if partition not in loaded.markers and legacy is not None:
            # Written by an older worker (and maybe runs saved since, newer): adopt both.
            runs = {**legacy["runs"], **runs}
        if offsets is None and not runs:
            return None
        return {"offsets": offsets or {}, "runs": runs}

    @staticmethod
    def _positions(loaded: "_Loaded", partition: int) -> dict[str, int] | None:
        found = loaded.markers.get(partition)
        if found is None and partition in loaded.legacy:
            found = loaded.legacy[partition]["offsets"]
        return found

    def ahead(self, partition: int) -> dict[str, dict[str, int]]:
        """Runs of ``partition`` saved past its positions: run_id -> {topic: first offset not yet in its state}."""
        loaded = self._read()
        marker = self._positions(loaded, partition) or {}
        found: dict[str, dict[str, int]] = {}
        for run, (p, offsets, _) in loaded.runs.items():
            if p != partition:
                continue
            past = {t: n for t, n in offsets.items() if n > marker.get(t, 0)}
            if past:
                found[run] = past
        return found

    def has_legacy(self, partition: int) -> bool:
        return partition in self._read().legacy

    def _read(self) -> "_Loaded":
        if self._loaded is None:
            loaded = _Loaded()
            for record in self.bus.read_all(self.topic):
                if record.key is None:
                    continue
                key = record.key.decode("utf-8", "replace")
                if record.value is None:  # a tombstone: the key is gone
                    loaded.drop(key, self)
                    continue
                try:
                    self._adopt(loaded, key, json.loads(record.value))
                except ValueError as exc:
                    # That run (or partition) starts afresh: it changes verdicts,
                    # so someone must hear about it.
                    self._count_unreadable()
                    what = f"partition {key}" if key.isdigit() else key
                    log.warning(
                        "%s: unreadable state snapshot for %s at offset %s (%s); it starts afresh",
                        self.topic,
                        what,
                        record.offset,
                        exc,
                    )
                    loaded.drop(key, self)
            self._loaded = loaded
        return self._loaded

    def _adopt(self, loaded: "_Loaded", key: str, value: Any) -> None:
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        if key.startswith(self._run_prefix):
            partition, offsets, state = (
                value.get("partition"),
                value.get("offsets"),
                value.get("state"),
            )
            if not (
                isinstance(partition, int) and isinstance(offsets, dict) and isinstance(state, dict)
            ):
                raise ValueError("not a run record with partition, offsets and state")
            loaded.runs[key[len(self._run_prefix) :]] = (partition, offsets, state)
        elif key.startswith(self._partition_prefix):
            offsets = value.get("offsets")
            if not isinstance(offsets, dict):
                raise ValueError("not a partition record with offsets")
            loaded.markers[int(key[len(self._partition_prefix) :])] = offsets
        elif key.isdigit():  # the older layout: one record per partition
            if not (isinstance(value.get("runs"), dict) and isinstance(value.get("offsets"), dict)):
                raise ValueError("not a snapshot object with offsets and runs")
            loaded.legacy[int(key)] = value
        else:
            raise ValueError(f"unknown key {key!r}")

    def _count_unreadable(self) -> None:
        self.unreadable += 1
        if self._on_unreadable is not None:
            self._on_unreadable()

    # -- writing --------------------------------------------------------------
    def save(
        self,
        producer: Producer,
        partition: int,
        offsets: dict[str, int],
        runs: dict[str, Any],
    ) -> list[str]:
        """Write these runs of ``partition`` (those that changed), then the partition's positions.

        Returns the runs refused for their size (their older record is tombstoned).
        The caller flushes.
        """
        refused = []
        for run_id, state in runs.items():
            key = self.run_key(run_id)
            value = _dumps({"partition": partition, "offsets": offsets, "state": state})
            size = len(value) + len(key.encode())
            if size > self.max_record_bytes:
                refused.append(run_id)
                self.refused += 1
                if self._on_refused is not None:
                    self._on_refused()
                log.warning(
                    "%s: state of run %s not saved: %d bytes is over the %d-byte record "
                    "limit; a restart starts that run afresh",
                    self.topic,
                    run_id,
                    size,
                    self.max_record_bytes,
                )
                producer.publish(self.topic, None, key=key)  # type: ignore[arg-type]
                continue
            producer.publish(self.topic, value, key=key)
        producer.publish(
            self.topic,
            json.dumps({"partition": partition, "offsets": offsets}).encode(),
            key=self.partition_key(partition),
        )
        return refused

    def delete_runs(self, producer: Producer, run_ids: list[str]) -> None:
        """Tombstone these runs' records (they ended or idled out). The caller flushes."""
        for run_id in run_ids:
            producer.publish(self.topic, None, key=self.run_key(run_id))  # type: ignore[arg-type]

    def delete_legacy(self, producer: Producer, partition: int) -> None:
        """Tombstone the older layout's record of ``partition`` (superseded by a partition record)."""
        producer.publish(self.topic, None, key=str(partition))  # type: ignore[arg-type]

    def invalidate(self) -> None:
        """Forget the topic contents read (another member may have written since; and memory)."""
        self._loaded = None


def _dumps(value: dict[str, Any]) -> bytes:
    """``json.dumps(value).encode()``, parsed back the same, ~8x faster (pydantic's JSON in Rust).

    A checkpoint encodes every changed run's state, mostly floats: with json.dumps that was
    three quarters of a 100-run checkpoint. NaN and infinities stay ``NaN``/``Infinity`` as
    json.dumps writes them (json.loads reads them back); a state it cannot encode goes through
    json.dumps, which raises the error it always raised.
    """
    try:
        return to_json(value, inf_nan_mode="constants")
    except Exception:  # noqa: BLE001 - the json module's own error (or output) decides
        return json.dumps(value).encode()


class _Loaded:
    """What the state topic holds, newest record per key."""

    def __init__(self) -> None:
        self.runs: dict[str, tuple[int, dict[str, int], dict[str, Any]]] = {}
        self.markers: dict[int, dict[str, int]] = {}
        self.legacy: dict[int, dict[str, Any]] = {}

    def drop(self, key: str, store: StateStore) -> None:
        if key.startswith(store._run_prefix):
            self.runs.pop(key[len(store._run_prefix) :], None)
        elif key.startswith(store._partition_prefix):
            tail = key[len(store._partition_prefix) :]
            if tail.isdigit():
                self.markers.pop(int(tail), None)
        elif key.isdigit():
            self.legacy.pop(int(key), None)
