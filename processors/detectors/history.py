"""Per-run detector state at past steps, so that a rollback can put it back.

After a rollback the trainer re-runs steps from a checkpoint, under a new
epoch. Judged with the state the detector had reached at the end of the first
pass, a re-run step of a falling loss curve looks like a jump up (the loss was
higher back then) and the detector alarms on healthy steps. So the state
before step ``t`` is kept for every ``every``-th step ``t`` (aligned with the
trainer's default checkpoint cadence), and on a new epoch the newest one at or
before the first re-run step comes back.

Bounded: at most ``keep`` snapshots. When full, the older half is thinned to
every other one, so the newest snapshots stay dense (short rollbacks are the
common ones) while the oldest reach back further and further.

A snapshot is whatever the detector's ``pack`` makes of the state, and
``rewind`` hands it to ``unpack`` for a state of its own: by default pickled
bytes of the state's ``dump`` (a statistical run's 14 snapshots: ~25 kB,
against 107 kB as live objects, most of a run's memory in a worker holding
10,000 runs); the ML detector shares its fitted forest and the prefix of its
pending rows, which are never changed in place. Snapshots live in memory only;
a restarted worker starts collecting them again (a rollback to before that is
judged from a fresh state, which warms up silently).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Callable, Generic, TypeVar

S = TypeVar("S")
T = TypeVar("T")


class StateHistory(Generic[S]):
    """Snapshots ``(step, state before that step)``, oldest first."""

    __slots__ = ("every", "keep", "_steps", "_states", "_next")

    def __init__(self, every: int = 50, keep: int = 16) -> None:
        if every < 1 or keep < 2:
            raise ValueError("StateHistory needs every >= 1 and keep >= 2")
        self.every = every
        self.keep = keep
        self._steps: list[int] = []
        self._states: list[S] = []
        self._next = 0  # the next step at (or after) which a snapshot is due

    def __len__(self) -> int:
        return len(self._steps)

    def steps(self) -> list[int]:
        return list(self._steps)

    def due(self, step: int) -> bool:
        return step >= self._next

    def save(self, step: int, state: S) -> None:
        """Keep ``state`` as the state before ``step``: packed, so later steps cannot change it."""
        self._steps.append(step)
        self._states.append(state)
        self._next = (step // self.every + 1) * self.every
        if len(self._steps) > self.keep:
            old = len(self._steps) - self.keep // 2  # the newest keep // 2 stay as they are
            keep_index = [i for i in range(len(self._steps)) if i >= old or i % 2 == 0]
            self._steps = [self._steps[i] for i in keep_index]
            self._states = [self._states[i] for i in keep_index]

    def rewind(self, step: int, copy: Callable[[S], T]) -> tuple[int, T] | None:
        """The newest snapshot at or before ``step``, dropping those after it.

        ``copy`` makes a state of its own from the snapshot (the detector's ``unpack``).

        None when there is none: the run is re-run from before anything kept.
        """
        i = bisect_right(self._steps, step)
        del self._steps[i:], self._states[i:]
        # The re-run's first step is worth a snapshot of its own, unless it has one.
        self._next = self._steps[-1] + 1 if i else 0
        if not i:
            return None
        return self._steps[i - 1], copy(self._states[i - 1])

    def clear(self) -> None:
        self._steps.clear()
        self._states.clear()
        self._next = 0
