"""Settings of the recovery policy: which strategy answers which anomaly, and every number it uses.

The defaults are the ``medium`` preset (see :mod:`spikeguard.actuators.presets`).
Steps here are *observed* steps: decisions the policy handled in order, so a
re-run after a rollback counts again (that is training time spent).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from spikeguard.processors.decision_table import CRITICAL_TYPES
from spikeguard.schemas import AnomalyType

A = AnomalyType


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # --- timing -----------------------------------------------------------
    apply_lag_steps: int = Field(
        1, ge=0, le=1000, description="actions apply at decision.step + this (every rank alike)"
    )

    # --- which anomaly type gets which strategy ------------------------------
    # A decision fusion calls critical gets the critical strategy (act at once: roll
    # back, skip, lower the LR, clip) unless its type is an explosion type. Which
    # decisions are critical is fusion's call alone (decision.critical).
    explosion_types: tuple[AnomalyType, ...] = Field(
        (A.GRADIENT_EXPLOSION,),
        description="lower the LR and clip at once; roll back if a loss anomaly follows "
        "(loss_scale_collapse is never one: the GradScaler recovers by itself, it is watched)",
    )
    spike_types: tuple[AnomalyType, ...] = Field(
        (A.LOSS_SPIKE, A.BAD_BATCH),
        description="judged after spike_patience_steps: roll back if still anomalous, else watch",
    )
    slow_types: tuple[AnomalyType, ...] = Field(
        (A.DIVERGENCE, A.OSCILLATION, A.SLOW_RISE),
        description="lower the LR step by step, emergency checkpoint, roll back if it continues",
    )
    preventive_types: tuple[AnomalyType, ...] = Field(
        (A.INSTABILITY_WARNING, A.STALLED, A.LR_TOO_HIGH),
        description="early warnings: checkpoint / gentle clipping only, rate-limited",
    )
    loss_types: tuple[AnomalyType, ...] = Field(
        (A.LOSS_SPIKE, A.NON_FINITE, A.EXTREME_LOSS),
        description="loss anomalies: after a gradient explosion in the same incident -> roll back",
    )
    # Any other anomalous type (ml_outlier, lr_out_of_bounds, loss_scale_collapse, none) gets
    # one ALERT per incident; an LR jump is remembered, the response to a rise after it.

    # --- patience ---------------------------------------------------------------
    spike_patience_steps: int = Field(
        3,
        ge=1,
        le=1000,
        description="a spike (or a finite extreme loss) still anomalous this many steps later is "
        "rolled back; one the run absorbed by then (its clipping, its optimizer) is only watched",
    )
    absorbed_grad_ratio: float = Field(
        10.0,
        gt=1.0,
        description="a finite extreme loss counts as absorbed only if its gradient norm stayed "
        "within this many times the baseline (the run's clipping bounded the update) ...",
    )
    absorbed_loss_margin: float = Field(
        0.1,
        ge=0.0,
        description="... and the loss, a patience later, is back within baseline + this x |baseline|",
    )
    non_finite_skipped_by_trainer: bool = Field(
        True,
        description="the trainer skips a non-finite update itself (the Guard always does), so "
        "one needs no recovery; False for a loop that does not: every non-finite decision is "
        "then recovered from at once",
    )
    non_finite_recur_steps: int = Field(
        50,
        ge=1,
        le=100_000,
        description="a non-finite step is skipped by the Guard itself and needs nothing more; "
        "a second one within this many steps is recovered from (critical)",
    )
    recovery_grace_steps: int = Field(
        5,
        ge=0,
        le=10_000,
        description="after a recovery, the incident's anomalies trigger nothing for this long",
    )
    divergence_step_interval_steps: int = Field(
        25, ge=1, le=100_000, description="steps between two LR steps of a slow divergence"
    )
    divergence_max_lr_steps: int = Field(
        3, ge=1, le=50, description="LR steps before a continuing divergence is rolled back"
    )

    # --- learning rate (factors relative to the base LR the guard recorded) ------
    lr_decrease_factor_critical: float = Field(
        0.5, gt=0.0, lt=1.0, description="non-finite / extreme loss"
    )
    lr_decrease_factor_explosion: float = Field(
        0.4, gt=0.0, lt=1.0, description="gradient explosion"
    )
    lr_decrease_factor_spike: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="a data-induced spike still there after its patience: rolling back and "
        "skipping its batches removes the cause, so by default the LR stays (PaLM's recipe)",
    )
    lr_step_factor_divergence: float = Field(0.8, gt=0.0, lt=1.0, description="one divergence step")
    lr_jump_factor: float = Field(
        0.1,
        gt=0.0,
        lt=1.0,
        description="an LR jump that comes again after one that needed a rollback: LR x this, "
        "back towards the schedule's trend (a first LR-induced rise gets HOLD_LR instead; the "
        "rules detector's lr_jump_ratio is 10 by default: the smallest jump it reports)",
    )
    lr_jump_window_steps: int = Field(
        100,
        ge=1,
        le=100_000,
        description="a loss or gradient anomaly this many steps after an LR jump is LR-induced",
    )
    lr_jump_hold_steps: int = Field(
        20,
        ge=0,
        le=1_000_000,
        description="after holding or scaling back an LR jump, no LR restore for this many "
        "steps (the decisions do not say when a jump in the schedule ends)",
    )
    damage_loss_ratio: float = Field(
        1.5,
        gt=1.0,
        le=1000.0,
        description="the loss's median over damage_window_steps this many times its level before "
        "an incident that lowered the LR (level + (ratio - 1) x |level|) is damage, not health: "
        "no LR restore, and an LR-induced incident is rolled back to before it",
    )
    damage_window_steps: int = Field(
        20,
        ge=1,
        le=10_000,
        description="the recent steps whose median loss is compared with the level before the "
        "incident (an LR-induced incident is judged once this many steps followed its scale-back)",
    )
    lr_ceiling_decrease_factor: float = Field(
        0.7,
        gt=0.0,
        le=1.0,
        description="each recurring gradient explosion lowers the ceiling the LR is restored to "
        "by this (1.0: restores always go back to the base LR)",
    )
    min_lr_factor: float = Field(
        0.05, gt=0.0, le=1.0, description="the LR never goes below base LR x this"
    )
    lr_restore_factor: float = Field(
        1.25, gt=1.0, le=10.0, description="one restore step multiplies the LR by this (cap: base)"
    )
    lr_restore_healthy_steps: int = Field(
        200, ge=1, le=1_000_000, description="healthy steps in a row before one restore step"
    )
    # --- mechanism signals (actuators/mechanisms.py) --------------------------------
    qk_clip_bar_fraction: float = Field(
        1 / 3,
        gt=0.0,
        le=1.0,
        description="attention-logit growth: QK-clip the heads at this share of the detector's "
        "bar (3 x the run's level: the level itself, 30 for a run whose level is under the "
        "detector's floor), so the clipped logits sit well under the bar",
    )
    mechanism_lr_cut: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="attention-logit growth cuts the LR by bar/value, at most this (the LR "
        "floor still holds)",
    )
    rollback_restores_lr: bool = Field(
        True,
        description="a rollback resets the guard's LR multiplier to the checkpoint's (the guard "
        "restores its state from the checkpoint); False for a guard whose multiplier survives "
        "rollbacks. The SCALE_LR sent after a rollback is relative to the LR the guard then has",
    )

    # --- gradient clipping --------------------------------------------------------
    clip_mode: Literal["max_norm", "adaptive"] = Field(
        "max_norm", description='CLIP params: {"max_norm": x} or {"mode": "adaptive", "z": z}'
    )
    clip_norm_initial: float = Field(
        1.0, gt=0.0, description="max_norm when clipping is first enabled"
    )
    clip_tighten_factor: float = Field(
        0.5, gt=0.0, lt=1.0, description="tightening multiplies max_norm by this"
    )
    min_clip_norm: float = Field(0.1, gt=0.0, description="max_norm never goes below this")
    max_clip_norm: float = Field(10.0, gt=0.0, description="max_norm never goes above this")
    adaptive_clip_z: float = Field(4.0, gt=0.0, le=100.0, description="z of adaptive clipping")
    preventive_clip: bool = Field(
        True,
        description="a warning may enable clipping, or tighten it one notch "
        "(never below clip_norm_initial x clip_tighten_factor)",
    )

    # --- optional user-handled knobs (REDUCE_BATCH_SIZE, SET_EPS) -----------------
    batch_size_actions: bool = Field(False, description="rollbacks also reduce the batch size")
    batch_size_decrease_factor: float = Field(0.5, gt=0.0, lt=1.0, description="one reduction")
    min_batch_size_factor: float = Field(
        0.25, gt=0.0, le=1.0, description="floor, relative to the start"
    )
    eps_actions: bool = Field(False, description="non-finite / loss-scale trouble raises Adam eps")
    eps_initial: float = Field(1e-8, gt=0.0, description="the optimizer's eps at start")
    eps_increase_factor: float = Field(10.0, gt=1.0, description="one increase multiplies eps")
    max_eps: float = Field(1e-5, gt=0.0, description="eps never goes above this")

    # --- rollback target and skipped data -------------------------------------------
    rollback_min_steps_before_onset: int = Field(
        100, ge=0, description="the target checkpoint is at least this many steps before onset"
    )
    skip_extra_batches: int = Field(
        4,
        ge=0,
        description="batches skipped beyond the anomalous window (onset to the judged step): a "
        "margin for a bad stretch that goes on past the judged step. Small, so that the skip is "
        "in proportion to the evidence (PaLM's 200-500 batches cost a run of a few thousand "
        "steps 10 % of its data for a few bad batches); the Guard's max_skip_share bounds it",
    )
    max_checkpoints: int = Field(32, ge=1, le=10_000, description="healthy checkpoints remembered")
    data_level_hold_steps: int = Field(
        500,
        ge=0,
        le=1_000_000,
        description="after a rise came back on other data once its window was skipped (the data's "
        "level changed): watch non-critical rises for this many steps instead of rolling back "
        "again; the slowest detector's relearning span (statistical.relearn_after)",
    )
    flat_rise_waits: bool = Field(
        True,
        description="a non-critical spike still elevated after spike_patience_steps, neither "
        "rising further nor with any update beyond absorbed_grad_ratio of its baseline gradient, "
        "is no evidence the weights are damaged: a harder data level and a stretch of bad data "
        "look the same then. It is watched instead of rolled back (one ALERT), for "
        "data_level_hold_steps; if it ends at once, as bad data does (bad_stretch_steps), its "
        "batches, onset to last elevated step, are rolled back and skipped then. False: roll back "
        "and skip at once, and let the re-run tell (PaLM's test)",
    )
    bad_stretch_steps: int = Field(
        10,
        ge=1,
        le=10_000,
        description="after a rise was called the data's level: when the first this-many healthy "
        "steps after its last elevated one have a median back near the level from before it "
        "(within a quarter of the rise), it ended as it began: a stretch of bad batches longer "
        "than the skipped window, rolled back and skipped from its onset to its last elevated step",
    )

    # --- escalation --------------------------------------------------------------
    max_rollbacks_per_incident: int = Field(
        1,
        ge=1,
        le=100,
        description="recoveries per incident; a critical decision needing one more stops the run "
        "(a non-critical one gets an alert: low-confidence evidence never stops a run)",
    )
    rollback_window_steps: int = Field(2000, ge=1, description="window of the rollback count")
    max_rollbacks_in_window: int = Field(
        3,
        ge=1,
        le=100,
        description="rollbacks allowed within the window; a critical decision needing one more "
        "stops the run",
    )
    rollback_ack_timeout_steps: int = Field(
        100, ge=1, description="a rollback not acknowledged this many steps later raises an alert"
    )

    # --- warnings and bookkeeping -----------------------------------------------------
    preventive_min_interval_steps: int = Field(
        100, ge=1, description="at most one preventive checkpoint per this many steps"
    )
    max_incidents: int = Field(16, ge=1, le=10_000, description="incidents remembered")
    seen_window_steps: int = Field(
        1000, ge=1, description="decision ids remembered for duplicate detection (in steps)"
    )

    @model_validator(mode="after")
    def _check(self) -> "PolicyConfig":
        groups = {
            "explosion_types": self.explosion_types,
            "spike_types": self.spike_types,
            "slow_types": self.slow_types,
            "preventive_types": self.preventive_types,
        }
        owner: dict[AnomalyType, str] = {}
        for name, types in groups.items():
            for kind in types:
                if kind in owner:
                    raise ValueError(f"{kind.value} is in both {owner[kind]} and {name}")
                owner[kind] = name
                if kind in CRITICAL_TYPES and name != "explosion_types":
                    raise ValueError(
                        f"{kind.value} is always critical (fusion's decision_table), so its "
                        f"decisions get the critical strategy and never reach {name}"
                    )
        if not self.min_clip_norm <= self.clip_norm_initial <= self.max_clip_norm:
            raise ValueError("clip_norm_initial must lie within [min_clip_norm, max_clip_norm]")
        if self.eps_initial > self.max_eps:
            raise ValueError("eps_initial must not exceed max_eps")
        return self

    def strategy_of(self, kind: AnomalyType, critical: bool = False) -> str:
        """'critical', 'explosion', 'spike', 'slow', 'preventive' or 'notice'.

        ``critical`` is the decision's own flag: fusion decides criticality, the
        policy only chooses the answer to it.
        """
        if kind in self.explosion_types:
            return "explosion"
        if critical:
            return "critical"
        for name in ("spike", "slow", "preventive"):
            if kind in getattr(self, f"{name}_types"):
                return name
        return "notice"
