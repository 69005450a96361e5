"""The loss-spike rules of four published trainers, reimplemented from their sources.

Each takes a :class:`StepEvent` and returns whether the step is flagged, and
runs over a run in order, exactly as its trainer would see it (one event per
logged point when the log is subsampled). What each rule does, and where that
was checked (sources read with the project's code/issue search, 2026-11-30):

- :class:`LightningSpike`: ``lightning.fabric.utilities.spike.SpikeDetection``
  (Lightning-AI/pytorch-lightning, ``src/lightning/fabric/utilities/spike.py``
  at 0c94c0e). Defaults ``window=10, warmup=1, atol=None, rtol=2.0,
  finite_only=True``: a step is a spike when the loss did not improve on the
  previous accepted loss and ``|loss - mean| >= 2 * mean`` of the running
  mean of the last 10 accepted losses, i.e. loss >= 3x that mean; a
  non-finite loss is a spike. Spikes do not enter the mean (the callback
  raises before ``_update_stats``); here the run goes on, as after a resume
  that skips the batch.
- :class:`KillLossSpike`: llm-foundry ``llmfoundry/callbacks/
  kill_loss_spike_callback.py`` (mosaicml/llm-foundry at 03826b5). Defaults
  ``patience=4, outlier_multiplier=2, window_size=100, loss_cap=10``: once
  100 losses are in, a loss >= 2x their mean is an outlier; the fifth
  consecutive outlier (counter > patience) and every one after it is flagged,
  a non-outlier resets the counter. Separately, from step 200 on, half of the
  window above ``loss_cap`` is flagged (high loss). Every loss enters the
  window, outliers and NaN included (the callback has no finiteness check, so
  a NaN makes the mean NaN until it leaves the window).
- :class:`MetaseqEwm`: metaseq ``Trainer.skip_spike`` (facebookresearch/
  metaseq PRs #521, #542 and #546): an exponentially weighted mean of the
  loss with ``span=9`` (alpha = 2 / (span + 1) = 0.2, started at the first
  loss); a batch is skipped when ``loss / ewm`` (the ewm before this loss,
  #546) exceeds ``ewm_ratio_to_skip_batch``. metaseq ships it off (-1) and
  leaves the number to the user: ``ratio`` 2.0 here is our choice, a
  doubling, as llm-foundry's default multiplier (not 1.5: that is the
  labelling rule's ratio, and would make this rule the labels' echo).
  Skipped losses are kept out of the mean (our reading of metaseq; the PR
  excerpts we could read do not show it either way).
  Non-finite losses are flagged (metaseq's trainer stops on them).
- :class:`AxolotlRobustZ`: a robust z-score on the median and 1.4826 x MAD of
  the last 100 accepted values, outliers kept out of the history, applied to
  the loss and to the gradient norm (axolotl's rule is a gradient-norm
  guard). We could not find its source in the searchable corpus, so this
  follows its published description; the threshold (z > 6, the same number of
  sigmas as OLMo-core's rule) and the 100-value warm-up are our choice.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from spikeguard.processors.robust_stats import robust_sigma
from spikeguard.schemas import StepEvent


class LightningSpike:
    name = "lightning"

    def __init__(self, window: int = 10, warmup: int = 1, rtol: float = 2.0) -> None:
        self.window = window
        self.warmup = warmup
        self.rtol = rtol
        self.values: deque[float] = deque(maxlen=window)
        self.last = 0.0
        self.seen = 0

    def update(self, event: StepEvent) -> bool:
        loss, index = event.loss, self.seen
        self.seen += 1
        spike = index >= self.warmup and self._is_spike(loss)
        if not spike and math.isfinite(loss):
            self.values.append(loss)
            self.last = loss
        return spike

    def _is_spike(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return True
        if loss - self.last <= 0:  # an improvement is never a spike
            return False
        mean = sum(self.values) / len(self.values) if self.values else 0.0
        return abs(loss - mean) >= abs(self.rtol * mean)


class KillLossSpike:
    name = "llm_foundry"

    def __init__(
        self, window: int = 100, multiplier: float = 2.0, patience: int = 4, loss_cap: float = 10.0
    ) -> None:
        self.window = window
        self.multiplier = multiplier
        self.patience = patience
        self.loss_cap = loss_cap
        self.losses: deque[float] = deque(maxlen=window)
        self.outliers = 0
        self.seen = 0

    def update(self, event: StepEvent) -> bool:
        loss, index = event.loss, self.seen
        self.seen += 1
        flagged = False
        if len(self.losses) == self.window:
            mean = sum(self.losses) / self.window
            if loss >= mean * self.multiplier:
                self.outliers += 1
                flagged = self.outliers > self.patience
            else:
                self.outliers = 0
            if not flagged:  # the callback's elif: the high-loss check
                high = sum(v > self.loss_cap for v in self.losses)
                flagged = index >= 2 * self.window and high >= self.window / 2
        self.losses.append(loss)
        return flagged


class MetaseqEwm:
    name = "metaseq"

    def __init__(self, span: int = 9, ratio: float = 2.0) -> None:
        self.span = span
        self.ratio = ratio
        self.alpha = 2.0 / (span + 1)
        self.ewm: float | None = None

    def update(self, event: StepEvent) -> bool:
        loss = event.loss
        if not math.isfinite(loss):
            return True
        if self.ewm is None:
            self.ewm = loss
            return False
        if self.ewm > 0 and loss / self.ewm > self.ratio:
            return True
        self.ewm = (1 - self.alpha) * self.ewm + self.alpha * loss
        return False


class PerSignalRule:
    """A rule applied to the loss and to the gradient norm, each against its own last values.

    A missing value (no gradient norm) is never flagged; a non-finite one always is and stays
    out of the window, as trainers check ``isfinite`` before anything else. :meth:`judge` says
    whether a finite value is flagged, and keeps it in the window or not.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.loss_history: deque[float] = deque(maxlen=window)
        self.grad_history: deque[float] = deque(maxlen=window)

    def judge(self, value: float, history: deque[float]) -> bool:
        raise NotImplementedError

    def update(self, event: StepEvent) -> bool:
        loss = self._check(event.loss, self.loss_history)
        grad = self._check(event.grad_norm, self.grad_history)
        return loss or grad

    def _check(self, value: float | None, history: deque[float]) -> bool:
        if value is None:
            return False
        if not math.isfinite(value):
            return True
        return self.judge(value, history)


class AxolotlRobustZ(PerSignalRule):
    name = "axolotl"

    def __init__(self, window: int = 100, min_values: int = 100, z: float = 6.0) -> None:
        super().__init__(window)
        self.min_values = min_values
        self.z = z

    def judge(self, value: float, history: deque[float]) -> bool:
        if len(history) >= self.min_values and robust_z(value, history) > self.z:
            return True  # an outlier never enters the history
        history.append(value)
        return False


def robust_z(value: float, history) -> float:
    """(value - median) / (1.4826 x MAD) of ``history``; inf above a constant history."""
    median = statistics.median(history)
    mad = robust_sigma(history, median)
    if mad == 0:
        return math.inf if value > median else 0.0
    return (value - median) / mad


TRAINER_RULES = {
    cls.name: cls for cls in (AxolotlRobustZ, MetaseqEwm, LightningSpike, KillLossSpike)
}
