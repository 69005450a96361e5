"""What every detector is: a pure object, step event in, verdict out.

One instance judges one run (the worker keeps one per ``run_id``), so its
state is that run's alone. No I/O: the same object runs in a worker, a
backtest and a unit test. State is bounded (independent of run length) and
round-trips through ``state_dict()`` / ``load_state_dict()`` as plain JSON
types, so a restarted worker resumes with exactly the state it had.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

from spikeguard.schemas import StepEvent, Verdict


class Detector(ABC):
    #: The verdict's ``detector`` field and the worker's name.
    name: ClassVar[str]

    @abstractmethod
    def update(self, event: StepEvent) -> Verdict:
        """Judge ``event`` against what came before, then learn from it (unless flagged)."""

    def update_many(self, events: Sequence[StepEvent]) -> list[Verdict]:
        """Judge a batch of one run's consecutive events; batch-friendly detectors override."""
        return [self.update(event) for event in events]

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The learned state, JSON-serialisable (floats may be NaN/inf)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
