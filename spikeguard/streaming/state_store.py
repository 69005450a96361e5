"""Per-partition state snapshots on a compacted topic of the bus itself.

A worker's state for the runs of partition ``p`` and the input offsets it
corresponds to are one record (key ``p``), so the pair is always consistent:
a restarted worker restores the state and seeks its inputs to those offsets,
and produces, for every step, the verdicts it would have produced without the
crash. Offsets are committed to the group only after the snapshot is flushed,
so the committed offsets never run ahead of a snapshot.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from spikeguard.bus import Bus, Producer

log = logging.getLogger(__name__)


class StateStore:
    def __init__(
        self, bus: Bus, topic: str, on_unreadable: Callable[[], None] | None = None
    ) -> None:
        self.bus = bus
        self.topic = topic
        #: Snapshots that could not be read; ``on_unreadable`` is called for each (a metric).
        self.unreadable = 0
        self._on_unreadable = on_unreadable
        self._loaded: dict[int, dict[str, Any]] | None = None

    def ensure_topic(self) -> None:
        self.bus.create_topics([self.topic], compacted=True)

    def load(self, partition: int) -> dict[str, Any] | None:
        """The newest snapshot of ``partition``: {"offsets": {topic: n}, "runs": {...}}."""
        if self._loaded is None:
            self._loaded = {}
            for record in self.bus.read_all(self.topic):
                if record.key is None or record.value is None:
                    continue
                try:
                    key = int(record.key)
                    snapshot = json.loads(record.value)
                    if not (isinstance(snapshot, dict) and isinstance(snapshot.get("runs"), dict)
                            and isinstance(snapshot.get("offsets"), dict)):
                        raise ValueError("not a snapshot object with offsets and runs")
                except ValueError as exc:
                    # Its partition starts afresh from the committed offsets: that
                    # changes verdicts, so someone must hear about it.
                    self.unreadable += 1
                    if self._on_unreadable is not None:
                        self._on_unreadable()
                    log.warning("%s: unreadable state snapshot for partition %s at offset %s "
                                "(%s); that partition starts afresh", self.topic,
                                record.key.decode(errors="replace"), record.offset, exc)
                    continue
                self._loaded[key] = snapshot
        return self._loaded.get(partition)

    def save(
        self,
        producer: Producer,
        partition: int,
        offsets: dict[str, int],
        runs: dict[str, Any],
    ) -> None:
        snapshot = {"offsets": offsets, "runs": runs}
        producer.publish(self.topic, json.dumps(snapshot).encode(), key=str(partition))
        if self._loaded is not None:
            self._loaded[partition] = snapshot

    def invalidate(self) -> None:
        """Forget the cached topic contents (another member may have written since)."""
        self._loaded = None
