"""A batch of one run's steps for the ``ml`` detector: rows and features computed once, ahead.

Features depend only on earlier events, never on verdicts, so a batch's rows are
known before any of it is judged: one pass over a copy of the run's features
makes them (and one vectorised clean-up), and the forest walks them in one go.
The copy, once through the batch, *is* the run's features after it, so the
detector adopts it instead of computing every step a second time; where a
rollback snapshot falls due inside the batch, the features at that step are
copied on the way (:meth:`Batch.features_before`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from spikeguard.processors.detectors.history import StateHistory
from spikeguard.processors.detectors.ml.forest import CompiledForest
from spikeguard.processors.features import ML_FEATURES, RollingFeatures
from spikeguard.schemas import StepEvent

_BOUND = 1e6  # keeps extreme-but-finite features finite in float32
_WIDTH = len(ML_FEATURES)


def clean(raw: np.ndarray) -> np.ndarray:
    """Rows (or one row) made finite and bounded, rounded so the buffer is exact and short in
    JSON (far below the noise). Elementwise: a batch's matrix gives each row's own result."""
    raw = np.nan_to_num(raw, nan=0.0, posinf=_BOUND, neginf=-_BOUND).clip(-_BOUND, _BOUND)
    return np.round(raw, 4)


class Batch:
    """A batch's rows, computed ahead on one copy of the features, and their forest path sums.

    ``items[i]`` is the i-th step's row index in ``rows``, or why it has none. Exact: the
    rows come from the very feature updates the run adopts (``after``), and leaf path
    lengths are summed exactly, so sums do not depend on the batch.
    """

    def __init__(
        self,
        features: RollingFeatures,
        events: Sequence[StepEvent],
        floor: float,
        history: StateHistory[Any],
    ) -> None:
        """``features``: the run's, before the batch (copied, never changed)."""
        self.events = events
        ahead = features.copy()
        raws: list[list[float]] = []
        self.items: list[int | str] = []
        # The features before each step a rollback snapshot is due at (what update() will
        # pack there), predicted as StateHistory.save moves its next due step.
        self.before: dict[int, RollingFeatures] = {}
        due_from: int | None = None
        for i, event in enumerate(events):
            if history.due(event.step) if due_from is None else event.step >= due_from:
                self.before[i] = ahead.copy()
                due_from = (event.step // history.every + 1) * history.every
            if not event.finite:
                self.items.append("non_finite")  # never enters the features
                continue
            f = ahead.update_event(event)
            if f is None:
                self.items.append("warmup")
            else:
                self.items.append(len(raws))
                raws.append(f.ml_vector(floor))
        self.rows = clean(np.array(raws, dtype=np.float64).reshape(-1, _WIDTH))
        self.after = ahead  # the features after the whole batch
        self.cursor = 0  # the step being judged
        self.tracked = 0  # steps whose features the run has moved past
        self._forest: CompiledForest | None = None
        self._first = 0
        self._sums: list[float] = []

    def path_sum(self, i: int, forest: CompiledForest) -> float:
        if forest is not self._forest or i < self._first:  # first use, or a refit since
            self._forest, self._first = forest, i
            self._sums = forest.path_sums(self.rows[i:]).tolist()
        return self._sums[i - self._first]

    def features_before(self, i: int, start: RollingFeatures) -> RollingFeatures:
        """The run's features before step ``i`` (``start``: before the batch)."""
        found = self.before.get(i)
        if found is None:  # a snapshot not predicted: replay (never happens in order)
            found = start.copy()
            for event in self.events[:i]:
                if event.finite:
                    found.update_event(event)
        return found
