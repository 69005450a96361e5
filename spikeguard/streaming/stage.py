"""A stage: what a worker runs. Events in, (topic, event) pairs out; no I/O.

Every stage here keeps one pure object per run (a detector, a fusion, a
policy), created on the run's first event. The worker loop owns the bus; the
stage only says which topics it reads, what it makes of a batch, and how its
per-run state is saved and restored (for crash-safe restarts).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from itertools import repeat
from typing import Any, Callable, Generic, Iterable, Protocol, Sequence, TypeVar

from pydantic import BaseModel

from spikeguard.schemas import Topics

Output = tuple[str, BaseModel]  # (topic, event); the key is the event's run_id


class RunState(Protocol):
    """What a stage holds per run: its state goes out and comes back as a dict."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


T = TypeVar("T", bound=RunState)
E = TypeVar("E", bound=BaseModel)


class Stage(ABC):
    """The processing half of a worker."""

    #: Component name: the consumer group suffix and the metrics label.
    name: str
    #: What the stage checks its inputs and signs its outputs with (settings.keys(): one key,
    #: or a key per role); None: unsigned. The worker's Signer and the offline pump read it.
    signing_key: Any = None

    def __init__(self, topics: Topics) -> None:
        self.topics = topics

    @abstractmethod
    def inputs(self) -> dict[str, type[BaseModel]]:
        """Topic -> the event model its records decode to."""

    @abstractmethod
    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        """Process decoded ``(topic, event)`` pairs in arrival order."""

    def tick(self, now: float) -> list[Output]:
        """Called after every poll, even an empty one (time-based deadlines)."""
        return []

    def flush(self) -> list[Output]:
        """End of input (a backtest): emit everything still pending."""
        return []

    def drain_ignored(self) -> dict[str, int]:
        """Records ignored on purpose (late, duplicate, ...) since the last call, by reason."""
        return {}

    @abstractmethod
    def snapshot(self, run_ids: Iterable[str]) -> dict[str, Any]:
        """The state of these runs, JSON-serialisable."""

    @abstractmethod
    def restore(self, state: dict[str, Any]) -> None:
        """Adopt what :meth:`snapshot` or :meth:`undo_point` returned (replacing those runs' state)."""

    def undo_point(self, run_ids: Iterable[str]) -> dict[str, Any]:
        """These runs' state now, for :meth:`restore` to put back if the coming batch fails.

        Taken before every batch, for the batch's runs only, and almost never used:
        it must be cheap. It never leaves the process, so unlike :meth:`snapshot` it
        may hold live immutable objects instead of their JSON (default: the snapshot).
        """
        return self.snapshot(run_ids)

    def forget(self, run_ids: Iterable[str]) -> None:  # noqa: B027 - optional: nothing to do by default
        """Drop these runs' state (their partition moved to another worker): no tombstone."""

    def end_runs(self, run_ids: Iterable[str]) -> None:  # noqa: B027 - optional: nothing to do by default
        """These runs ended (or idled out): drop their state and queue their tombstones."""

    def drain_ended(self) -> list[str]:
        """Runs ended since the last call; the worker tombstones their saved state."""
        return []

    def touch(self, run_ids: Iterable[str], now: float) -> None:  # noqa: B027 - optional: nothing to do by default
        """These runs had records at wall time ``now`` (idle eviction counts from there)."""

    def idle_runs(self, now: float, ttl_s: float) -> list[str]:
        """Runs held in memory with no record for more than ``ttl_s`` seconds."""
        return []

    def flush_runs(self, run_ids: Iterable[str]) -> list[Output]:
        """What these runs still hold, emitted before they are evicted for idling (default none)."""
        return []


class PerRunStage(Stage, Generic[T]):
    """A stage holding one object per run, built by ``factory(run_id)``.

    A run's object is dropped when the run ends (:meth:`end_runs`, called by a
    stage that reads the run's end) or when it has had no record for the
    worker's idle TTL: memory follows the live runs, not every run ever seen.
    """

    def __init__(self, topics: Topics, factory: Callable[[str], T]) -> None:
        super().__init__(topics)
        self.factory = factory
        self.runs: dict[str, T] = {}
        #: run_id -> wall time of its newest record (see :meth:`touch`).
        self.last_seen: dict[str, float] = {}
        self._ended: dict[str, None] = {}  # ordered set: tombstones go out in end order
        self._high = 0  # most runs held since the dicts were last rebuilt

    def run(self, run_id: str) -> T:
        found = self.runs.get(run_id)
        if found is None:
            found = self.runs[run_id] = self.factory(run_id)
            if len(self.runs) > self._high:
                self._high = len(self.runs)
        return found

    def snapshot(self, run_ids: Iterable[str]) -> dict[str, Any]:
        return {run_id: self.runs[run_id].state_dict() for run_id in run_ids if run_id in self.runs}

    def undo_point(self, run_ids: Iterable[str]) -> dict[str, Any]:
        # A run's object may keep its undo state cheaper than its state_dict (``undo_state``,
        # which its load_state_dict also takes): the per-batch copy need not be JSON.
        runs, out = self.runs, {}
        for run_id in run_ids:
            found = runs.get(run_id)
            if found is not None:
                undo: Callable[[], dict[str, Any]] = getattr(found, "undo_state", found.state_dict)
                out[run_id] = undo()
        return out

    def restore(self, state: dict[str, Any]) -> None:
        now = time.time()
        for run_id, run_state in state.items():
            self.run(run_id).load_state_dict(run_state)
            # Restored, so alive (a batch rewound after end_runs must not tombstone it),
            # and its idle time counts from now, not from before a restart.
            self._ended.pop(run_id, None)
            self.last_seen[run_id] = now

    def forget(self, run_ids: Iterable[str]) -> None:
        for run_id in run_ids:
            self.runs.pop(run_id, None)
            self.last_seen.pop(run_id, None)

    def end_runs(self, run_ids: Iterable[str]) -> None:
        run_ids = list(run_ids)
        self.forget(run_ids)  # subclasses drop their own per-run extras there
        self._ended.update(dict.fromkeys(run_ids))
        if len(self.runs) < self._high // 4:
            # A dict keeps the table of its largest size: after a wave of runs has
            # ended, rebuild the per-run dicts so that their memory goes too.
            self._high = len(self.runs)
            self.shrink()

    def shrink(self) -> None:
        """Rebuild the per-run dicts at their present size (subclasses add theirs)."""
        self.runs = dict(self.runs)
        self.last_seen = dict(self.last_seen)

    def drain_ended(self) -> list[str]:
        ended = list(self._ended)
        self._ended.clear()
        return ended

    def touch(self, run_ids: Iterable[str], now: float) -> None:
        self.last_seen.update(zip(run_ids, repeat(now)))

    def idle_runs(self, now: float, ttl_s: float) -> list[str]:
        oldest = now - ttl_s
        return [run_id for run_id, seen in self.last_seen.items() if seen < oldest]


def group_by_run(events: Sequence[E]) -> dict[str, list[E]]:
    """Events per run, each run's list in arrival order (dicts keep insertion order)."""
    grouped: dict[str, list[E]] = {}
    for event in events:
        grouped.setdefault(event.run_id, []).append(event)  # type: ignore[attr-defined]
    return grouped
