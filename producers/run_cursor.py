"""Where a guarded run stands: what the Guard's collaborators read and, on resume, set.

The Guard is one. Its checkpoint keeper (checkpointing.py) and its action
applier (applying.py) are handed it as a :class:`RunCursor`, so what they may
touch of the Guard is declared here and nowhere else.
"""

from __future__ import annotations

from typing import Protocol


class RunCursor(Protocol):
    """The run's live position and tallies (the Guard's public attributes of the same names)."""

    run_id: str
    #: The step the next ``step()`` call is.
    step_count: int
    #: The rollback generation: rollbacks applied so far (``epoch`` on the wire).
    generation: int
    #: The run is done and will not be resumed (lifecycle.py).
    finished: bool
    #: What the Guard did, counted (``Guard.counters``).
    counters: dict[str, int]

    def request_stop(self, reason: str) -> None: ...
