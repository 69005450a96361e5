"""The responses the recovery policy chooses between, one per cause it can tell from the evidence.

Every action the policy emits says which response it belongs to: its reason
starts with ``[response]`` (for example ``[data_spike] loss spike at step
812 still anomalous 3 steps later: roll back ...``), so the trainer's log,
the report and a replay show the choice and why it was made.
"""

from __future__ import annotations

from enum import Enum


class Response(str, Enum):
    # A non-finite loss or gradient: the Guard skipped that update itself; nothing more
    # unless it recurs (then the run itself is broken: roll back).
    NON_FINITE_SKIPPED = "non_finite_skipped"
    NON_FINITE_RECURRING = "non_finite_recurring"
    # A spike that outlived its patience, no explosion and no LR jump before it: the data.
    # Roll back and skip the window that led into it; the LR stays.
    DATA_SPIKE = "data_spike"
    # A spike or an extreme loss that was back to normal within its patience: the run (its
    # clipping, its optimizer) absorbed it. Checkpoint and watch; no rollback.
    ABSORBED = "absorbed"
    # The LR in the steps jumped, then the loss or the gradient rose (an anomaly after the
    # rules' lr_jump, or the detector's lr_induced_rise: a jump beyond any rate the run had
    # trained at): scale the LR back, no restore while the jump may persist, no rollback on
    # the loss alone.
    LR_INDUCED = "lr_induced"
    # An LR jump alone (a warm restart looks the same): said, nothing changed.
    LR_JUMP_WATCHED = "lr_jump_watched"
    # The GradScaler's scale collapsed: the scaler manages itself; alert and watch.
    LOSS_SCALE_WATCHED = "loss_scale_watched"
    # A gradient explosion: lower the LR and clip; a recurring one lowers the restore ceiling.
    EXPLOSION = "explosion"
    RECURRING_EXPLOSION = "recurring_explosion"
    # A loss anomaly following an explosion in the same incident: roll back, LR lowered.
    UNSTABLE = "unstable"
    # A critical decision (fusion's call) that is not one of the above: roll back at once.
    CRITICAL = "critical"
    # A slow rise or divergence well outside the run's own wander (the detectors' urgency is
    # above low): LR steps; a rollback only if it goes on and the loss is damaged.
    SLOW_RISE = "slow_rise"
    # A slow rise of low urgency: inside the run's own wander at that time scale. One alert.
    SLOW_WATCHED = "slow_watched"
    # A rise that came back on other data right after a rollback skipped the batches that
    # led into it (PaLM's test): the data's level changed (harder data, not a bad batch).
    # Undo the LR the rise lowered and watch non-critical rises while the detectors relearn.
    DATA_LEVEL = "data_level"
    # A spike still elevated after its patience, flat, no update of it known to be unbounded:
    # no sign of damage, and a harder data level looks the same. Watched, no rollback; if it
    # ends at once as bad data does, BAD_STRETCH rolls it back then.
    FLAT_RISE = "flat_rise"
    # A rise called the data's level that then ended at once, the loss back at the level from
    # before it: it was a stretch of bad batches longer than the skipped window, not the data's
    # level (a harder level does not end). Roll back and skip the stretch, onset to last
    # elevated step; once per rise, the LR and clipping as they are.
    BAD_STRETCH = "bad_stretch"
    # One isolated outlier step: the Guard's local rule answers it.
    OUTLIER_STEP = "outlier_step"
    # A mechanism signal over the run's own bar (attention-logit growth): QK-clip the
    # offending heads and cut the LR by the evidence, before the loss moves.
    MECHANISM = "mechanism"
    # Early warnings: checkpoint, gentle clipping, never more.
    PREVENTIVE = "preventive"
    # Any other anomaly type: one alert per incident.
    NOTICE = "notice"
    # Healthy steps: restore what the policy lowered, up to the ceiling.
    RESTORE = "restore"
    # A rollback skipped the data that led into an incident, and the re-run trained on the
    # batches after it without an anomaly: the cause is gone, the LR its recovery cut comes
    # back at once (to the checkpoint's).
    CAUSE_REMOVED = "cause_removed"
    # A recovery the evidence does not warrant (not critical past the budget, or no
    # checkpoint for an unconfirmed incident): alert and watch instead of acting.
    WATCH = "watch"
    # A critical decision recurring after the recoveries allowed: stop.
    STOP = "stop"


def tagged(response: Response, reason: str) -> str:
    """``reason`` with its response in front, as every action of the policy carries it."""
    return f"[{response.value}] {reason}"
