"""What fusion says about each anomaly type: whether it is critical, and its urgency.

Kept apart from :mod:`.fusion` so the table reads as a table. What to *do*
about a type is not here: that is the recovery policy's alone
(:mod:`spikeguard.actuators.config`).
"""

from __future__ import annotations

from spikeguard.schemas import AnomalyType, Urgency, Verdict

# Which detector's view of the type wins when several flag the same step.
DEFAULT_PRECEDENCE = ("rules", "statistical", "ml")

# The predictor's early warnings: preventive decisions, never rollbacks.
WARNING_TYPES = frozenset(
    {AnomalyType.INSTABILITY_WARNING, AnomalyType.STALLED, AnomalyType.LR_TOO_HIGH}
)

# Types that count at full weight in fusion whatever the weight of the detector that
# reports them: a detector's weight reflects its generic outliers (the ml forest's 0.5);
# these are specific findings no other detector can confirm, so they must decide alone.
FULL_WEIGHT_TYPES = frozenset({AnomalyType.LAYER_BLOWUP, AnomalyType.ATTENTION_LOGIT_GROWTH})

# Types that are critical whatever detector reports them.
CRITICAL_TYPES = frozenset({AnomalyType.NON_FINITE, AnomalyType.EXTREME_LOSS})


def is_critical(verdict: Verdict) -> bool:
    """The one rule of criticality: the detector is sure on its own, or the type always is."""
    return verdict.critical or verdict.type in CRITICAL_TYPES


BASE_URGENCY: dict[AnomalyType, Urgency] = {
    AnomalyType.NON_FINITE: Urgency.CRITICAL,
    AnomalyType.EXTREME_LOSS: Urgency.CRITICAL,
    AnomalyType.GRADIENT_EXPLOSION: Urgency.HIGH,
    AnomalyType.LOSS_SPIKE: Urgency.HIGH,
    AnomalyType.DIVERGENCE: Urgency.HIGH,
    AnomalyType.LOSS_SCALE_COLLAPSE: Urgency.HIGH,
    AnomalyType.OSCILLATION: Urgency.MEDIUM,
    AnomalyType.SLOW_RISE: Urgency.MEDIUM,
    AnomalyType.LR_OUT_OF_BOUNDS: Urgency.MEDIUM,
    AnomalyType.LR_INDUCED_RISE: Urgency.MEDIUM,  # the LR is scaled back, nothing rolled back
    AnomalyType.BAD_BATCH: Urgency.MEDIUM,
    AnomalyType.ML_OUTLIER: Urgency.LOW,
    AnomalyType.LAYER_BLOWUP: Urgency.MEDIUM,  # a precursor: the loss has not moved yet
    AnomalyType.ATTENTION_LOGIT_GROWTH: Urgency.MEDIUM,  # a precursor too: QK-clip, LR cut
    AnomalyType.OUTLIER_STEP: Urgency.LOW,  # skip that one update and record the batch
    AnomalyType.INSTABILITY_WARNING: Urgency.LOW,
    AnomalyType.STALLED: Urgency.LOW,
    AnomalyType.LR_TOO_HIGH: Urgency.LOW,
    AnomalyType.NONE: Urgency.NONE,
}

_LEVELS = (Urgency.NONE, Urgency.LOW, Urgency.MEDIUM, Urgency.HIGH, Urgency.CRITICAL)


def urgency(kind: AnomalyType, confidence: float, critical: bool, low_confidence: float) -> Urgency:
    """Critical verdicts are critical; otherwise the type's level, one lower when unsure."""
    if critical:
        return Urgency.CRITICAL
    level = BASE_URGENCY.get(kind, Urgency.MEDIUM)
    if level == Urgency.CRITICAL:  # a critical type reported without the critical flag
        level = Urgency.HIGH
    if confidence < low_confidence and level not in (Urgency.NONE, Urgency.LOW):
        level = _LEVELS[_LEVELS.index(level) - 1]
    return level
