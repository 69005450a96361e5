"""Which checkpoint to roll back to, from the CheckpointEvents the trainer published.

Only healthy checkpoints can be targets, so only they are kept: an unhealthy
checkpoint (saved during trouble) never pushes a healthy one out of the list.
The list is bounded; the oldest goes first, so the newest healthy one always
stays.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass
from typing import Any

from spikeguard.schemas import CheckpointEvent


@dataclass(frozen=True, order=True)
class Checkpoint:
    step: int
    checkpoint_id: str
    reason: str = "periodic"


class CheckpointBook:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.healthy: list[Checkpoint] = []  # step-sorted
        self.unhealthy_seen = 0
        self.newest_step: int | None = None  # of any checkpoint, healthy or not

    def add(self, event: CheckpointEvent) -> None:
        if event.deleted:  # rotated out on the trainer's disk: it cannot be restored any more
            self.discard(event.checkpoint_id)
            return
        newest = self.newest_step
        self.newest_step = event.step if newest is None else max(newest, event.step)
        if not event.healthy:
            self.unhealthy_seen += 1
            return
        # The same id again (redelivery) or a new checkpoint at the same step replaces the entry.
        self.healthy = [
            c
            for c in self.healthy
            if c.checkpoint_id != event.checkpoint_id and c.step != event.step
        ]
        bisect.insort(self.healthy, Checkpoint(event.step, event.checkpoint_id, event.reason))
        del self.healthy[: max(0, len(self.healthy) - self.capacity)]

    def target(self, onset_step: int, min_steps_before: int) -> Checkpoint | None:
        """The newest healthy checkpoint at least ``min_steps_before`` steps before the onset."""
        limit = onset_step - min_steps_before
        eligible = [c for c in self.healthy if c.step <= limit]
        return eligible[-1] if eligible else None

    def drop_after(self, step: int) -> list[Checkpoint]:
        """A rollback to ``step`` abandons what came after: forget (and return) its checkpoints."""
        dropped = [c for c in self.healthy if c.step > step]
        self.healthy = [c for c in self.healthy if c.step <= step]
        return dropped

    def put_back(self, checkpoints: list[Checkpoint], except_id: str | None = None) -> None:
        """Undo :meth:`drop_after` (the rollback failed), leaving out the checkpoint that failed."""
        known = {c.checkpoint_id for c in self.healthy}
        for c in checkpoints:
            if c.checkpoint_id != except_id and c.checkpoint_id not in known:
                bisect.insort(self.healthy, c)
        del self.healthy[: max(0, len(self.healthy) - self.capacity)]

    def discard(self, checkpoint_id: str) -> None:
        self.healthy = [c for c in self.healthy if c.checkpoint_id != checkpoint_id]

    @property
    def oldest_step(self) -> int | None:
        return self.healthy[0].step if self.healthy else None

    def state_dict(self) -> dict[str, Any]:
        return {
            "healthy": [asdict(c) for c in self.healthy],
            "unhealthy_seen": self.unhealthy_seen,
            "newest_step": self.newest_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.healthy = sorted(Checkpoint(**c) for c in state["healthy"])
        self.unhealthy_seen = int(state["unhealthy_seen"])
        self.newest_step = state["newest_step"]
