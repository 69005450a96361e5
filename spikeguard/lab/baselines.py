"""The two baselines spikeguard's detectors must beat, exactly as commonly written.

``NaiveBaseline`` is the approach found in many training scripts and
tutorials: over the previous 20 losses, a z-score above 2.5 scores 0.4, a
jump of more than 50 % over the previous loss scores 0.3, a normalised 5-step
slope above 0.2 scores 0.2; the step is anomalous when the score exceeds 0.5.
A non-finite loss is always anomalous. Apart from the first 10 steps there is
no warm-up, and every loss (NaN included) enters the window. It is written the
way such code usually is (numpy per step, ``np.polyfit`` for the slope).

``SixSigmaBaseline`` is the rule production trainers use: flag a step when
the loss, or the gradient norm, exceeds the mean of its previous 128 values by
more than 6 standard deviations, once 64 values are in. Every finite value
enters its window (flagged ones too). A non-finite value is flagged and kept
out of the window, as those trainers check ``isfinite`` before anything else.

The rules of four published trainers (axolotl, metaseq, Lightning,
llm-foundry) are in :mod:`spikeguard.lab.trainer_rules` and registered in
:data:`BASELINES` too. All take a :class:`StepEvent` and return a bool; :func:`flag_run` turns a
run into :class:`~spikeguard.lab.evaluation.Mark` s for scoring.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterable

import numpy as np

from spikeguard.lab.evaluation import Mark
from spikeguard.lab.trainer_rules import TRAINER_RULES, PerSignalRule
from spikeguard.schemas import StepEvent


class NaiveBaseline:
    name = "naive"

    def __init__(
        self,
        window: int = 20,
        z_threshold: float = 2.5,
        jump: float = 0.5,
        slope_steps: int = 5,
        slope_threshold: float = 0.2,
        threshold: float = 0.5,
        warmup: int = 10,
    ) -> None:
        self.window = window
        self.z_threshold = z_threshold
        self.jump = jump
        self.slope_steps = slope_steps
        self.slope_threshold = slope_threshold
        self.threshold = threshold
        self.warmup = warmup
        self.history: deque[float] = deque(maxlen=window)
        self.last_score = 0.0

    def score(self, loss: float) -> float:
        """The score of ``loss`` against the history (before it is added)."""
        if not math.isfinite(loss):
            return 1.0
        if len(self.history) < self.warmup:
            return 0.0
        with np.errstate(invalid="ignore", divide="ignore"):  # NaN in the window: by design
            return self._score(loss, np.array(self.history))

    def _score(self, loss: float, values: np.ndarray) -> float:
        score = 0.0
        z = abs(loss - values.mean()) / (values.std() + 1e-8)
        if z > self.z_threshold:
            score += 0.4
        previous = values[-1]
        if (loss - previous) / (abs(previous) + 1e-8) > self.jump:
            score += 0.3
        recent = np.append(values[-(self.slope_steps - 1) :], loss)
        slope = np.polyfit(np.arange(len(recent)), recent, 1)[0]
        if slope / (abs(recent.mean()) + 1e-8) > self.slope_threshold:
            score += 0.2
        return score

    def update(self, event: StepEvent) -> bool:
        self.last_score = self.score(event.loss)
        self.history.append(event.loss)
        return self.last_score > self.threshold


class SixSigmaBaseline(PerSignalRule):
    name = "six_sigma"

    def __init__(self, window: int = 128, min_values: int = 64, sigmas: float = 6.0) -> None:
        super().__init__(window)
        self.min_values = min_values
        self.sigmas = sigmas

    def judge(self, value: float, history: deque[float]) -> bool:
        flagged = False
        if len(history) >= self.min_values:
            values = np.array(history)
            flagged = bool(value > values.mean() + self.sigmas * values.std())
        history.append(value)  # flagged values too
        return flagged


BASELINES: dict[str, type] = {
    NaiveBaseline.name: NaiveBaseline,
    SixSigmaBaseline.name: SixSigmaBaseline,
}
BASELINES.update(TRAINER_RULES)


def flag_run(baseline, events: Iterable[StepEvent]) -> list[Mark]:
    """Run ``baseline`` over one run's events: a mark per step."""
    return [Mark(e.step, baseline.update(e)) for e in events]
