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
from typing import Any

from spikeguard.bus import Bus, Producer


class StateStore:
    def __init__(self, bus: Bus, topic: str) -> None:
        self.bus = bus
        self.topic = topic
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
                    self._loaded[int(record.key)] = json.loads(record.value)
                except ValueError:
                    continue  # a snapshot we cannot read is one we do not have
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
