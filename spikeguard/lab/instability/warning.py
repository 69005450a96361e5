"""Early warning: when each signal crosses its threshold, against the loss alarm.

A signal *warns* at the first step it crosses its threshold (from step
``start`` on). Its *lead* on an unstable run is ``alarm - warning`` steps:
positive when it warned first, negative when the loss moved first, None when
either never came. On a healthy run any warning is a false one.

The thresholds were chosen on seed 0 of :data:`~.mechanisms.HEALTHY` and of the
unstable recipes (bench_instability.py measures on seeds 1-5):

- ``attention_max`` 50: the max attention logit of the healthy recipe peaks
  near 25; Kimi K2 clips at 100 in a model 100x wider (logits grow with width).
- ``update_ratio`` 0.05: the largest per-layer update ratio of the healthy
  recipe peaks near 0.035, at the end of its warm-up.
- ``z_drift`` 1.0 nats: how far z moves from its level at step 30; z of every
  recipe tried stays within about 0.8 of it.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

from spikeguard.lab.instability.train import LabRun, StepRecord
from spikeguard.processors.detectors.mechanism import MECHANISM_RULES
from spikeguard.processors.detectors.rules import RulesDetector
from spikeguard.schemas import StepEvent


class Signal(NamedTuple):
    name: str
    threshold: float
    start: int  # steps before this are not judged
    value: Callable[[StepRecord, LabRun], float]


def _z_drift(record: StepRecord, run: LabRun) -> float:
    reference = run.steps[min(Z_REFERENCE_STEP, len(run.steps) - 1)].signals.z
    return abs(record.signals.z - reference)


Z_REFERENCE_STEP = 30
SIGNALS = (
    Signal("attention_max", 50.0, 0, lambda r, run: r.signals.max_attention_logit),
    Signal("update_ratio", 0.05, 0, lambda r, run: r.signals.max_update_ratio),
    Signal("z_drift", 1.0, Z_REFERENCE_STEP + 1, _z_drift),
)


def first_warning(run: LabRun, signal: Signal) -> int | None:
    for record in run.steps[signal.start :]:
        value = signal.value(record, run)
        if not math.isfinite(value) or value > signal.threshold:
            return record.step
    return None


def lead(alarm: int | None, warning: int | None) -> int | None:
    return None if alarm is None or warning is None else alarm - warning


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def detector_flags(run: LabRun) -> list[int]:
    """The steps the pipeline's own mechanism rules (processors/detectors/mechanism.py, in the
    rules detector, defaults) flag: each would be a ``qk_clip`` and an LR cut through the policy."""
    rules, flagged = RulesDetector(), []
    for r in run.steps:
        signals = r.signals
        event = StepEvent(
            run_id="lab",
            step=r.step,
            loss=r.loss,
            grad_norm=r.grad_norm,
            lr=r.lr,
            time=float(r.step),
            attention_logit_max=signals.max_attention_logit if signals.attention_max else None,
            update_ratio=signals.max_update_ratio if signals.update_ratio else None,
        )
        if MECHANISM_RULES.intersection(rules.update(event).rules):
            flagged.append(r.step)
    return flagged
