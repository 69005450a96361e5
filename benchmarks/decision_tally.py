"""The steps a guarded run's pipeline has decided, read as the decisions arrive on the trainer's bus.

The trainer's bus keeps only the last ``embedded_keep_consumed`` records of a topic that no
group reads, so a benchmark that wants every decision of a long run reads them as a group of
its own, committing as it goes (its memory then stays bounded too). The group is the run's own:
a tally of an earlier run on the same runtime that was never closed would otherwise still hold
the topic's partition, and this one would read nothing.
"""

from __future__ import annotations

from typing import Any

from spikeguard.schemas import Decision


class DecisionTally:
    def __init__(self, guard: Any, group: str = "benchmark-decisions") -> None:
        self._consumer = guard.bus.consumer(f"{group}-{guard.run_id}", [guard.topics.decisions])
        self._consumer.assignment()  # a member from now on: nothing it has not read is trimmed
        self.steps: set[int] = set()

    def update(self) -> set[int]:
        """Read what arrived since the last call; every step decided so far."""
        while batch := self._consumer.poll(max_records=5000, timeout=0.0):
            self.steps.update(r.decoded(Decision).step for r in batch)
            self._consumer.commit()
        return self.steps

    def close(self) -> None:
        self._consumer.close()
