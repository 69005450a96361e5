"""Where a guarded run stands: the one record the Guard's parts read and move.

The Guard builds its parts over one :class:`RunState` (its step, rollback
generation, counters, stop state); the parts change the run through it and
never call back into the Guard. ``Guard.step_count`` and the rest are this
record's fields under the Guard's public names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spikeguard.producers.checkpoints import CheckpointInfo


@dataclass(eq=False)  # compared as a mapping: counters == {"steps": 3, ...}
class Counters(Mapping[str, int]):
    """What the Guard did, counted (``guard.counters``; ``summary()`` puts it in words).

    Read and bumped by name as well (``counters["rollbacks"] += 1``); a name that is
    not a field is a KeyError, so a misspelt counter fails instead of starting a new one.
    """

    steps: int = 0  # step calls, re-run ones included
    updates: int = 0  # updates applied
    skipped_updates: int = 0  # updates the Guard skipped itself: non-finite, outlier, transient
    skipped_update_batches: int = 0  # their micro-batches, with gradient accumulation
    rollbacks: int = 0
    checkpoints: int = 0
    actions_applied: int = 0  # actions that change the run (the summary's "actions applied")
    acks: int = 0
    skipped_batches: int = 0  # data skipped by skip windows, in micro-batches...
    skipped_steps: int = 0  # ...and in steps
    scaler_skips: int = 0  # a GradScaler's own overflows
    outlier_skips: int = 0  # outlier steps found
    transient_steps: int = 0  # steps a re-run found different
    actions_withheld: int = 0  # not applied: mode or recovery budget
    notices_applied: int = 0  # alerts and requested checkpoints: they change nothing

    def __getitem__(self, name: str) -> int:
        if name not in _NAMES:
            raise KeyError(name)
        return int(getattr(self, name))

    def __setitem__(self, name: str, value: int) -> None:
        if name not in _NAMES:
            raise KeyError(name)
        setattr(self, name, value)

    def __iter__(self) -> Iterator[str]:
        return iter(_NAMES)

    def __len__(self) -> int:
        return len(_NAMES)


_NAMES = tuple(f.name for f in fields(Counters))


@dataclass
class RunState:
    """The run's live position, tallies and stop state."""

    run_id: str
    #: The step the next ``step()`` call is: goes back on a rollback.
    step_count: int = 0
    #: The rollback generation: rollbacks applied so far (``epoch`` on the wire).
    generation: int = 0
    counters: Counters = field(default_factory=Counters)
    #: The run is done and will not be resumed (lifecycle.py).
    finished: bool = False
    should_stop: bool = False
    stop_reason: str | None = None
    #: The run's length in optimizer steps, when known (``guard.data(..., max_steps=)``).
    max_steps: int | None = None
    #: The checkpoint this process resumed from (None: it started afresh).
    resumed_from: CheckpointInfo | None = None

    def request_stop(self, reason: str) -> None:
        self.should_stop, self.stop_reason = True, reason

    def done(self) -> bool:
        """A stop was asked for, or the planned steps have run."""
        return self.should_stop or (
            self.max_steps is not None and self.step_count >= self.max_steps
        )


def run_field(name: str, doc: str) -> Any:
    """A field of ``holder.state`` (a RunState) as a property of the holder (the Guard)."""
    return property(
        lambda holder: getattr(holder.state, name),
        lambda holder, value: setattr(holder.state, name, value),
        doc=doc,
    )
