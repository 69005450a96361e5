"""The trainer guard's settings (``SPIKEGUARD_GUARD__<FIELD>``).

Runtime objects (the model, the optimizer, the bus) are passed to the Guard
itself, never stored here: this is only what a user would put in a file.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class GuardMode(str, Enum):
    """How far the Guard may act on its own findings.

    ``protect``: everything the pipeline decides is applied (the default).
    ``observe``: the whole pipeline runs and every action is logged, reported and
    counted as what it *would* do; nothing is applied, not even the Guard's own
    update skips. The mode for a first run on a new model.
    ``skip-only``: only the Guard's own update skips (a non-finite or isolated
    outlier step); the pipeline's actions are logged as what they would do.
    """

    PROTECT = "protect"
    OBSERVE = "observe"
    SKIP_ONLY = "skip-only"


class ResumeMode(str, Enum):
    """What a Guard does when its run_id already has checkpoints (as W&B's ``resume=``).

    ``auto``: resume an unfinished run (a crash, a kill), start a finished one
    afresh with its files moved aside; one WARNING line says which.
    ``must``: resume, or raise if there is nothing unfinished to resume.
    ``never``: always start from step 0; earlier checkpoints are moved aside.
    """

    AUTO = "auto"
    MUST = "must"
    NEVER = "never"


class GuardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint_dir: str | None = Field(
        None,
        description="where checkpoints and the applied-action ledger live; "
        "None means ./spikeguard-checkpoints/<run_id>",
    )
    checkpoint_every: int = Field(
        50, ge=0, description="steps between periodic checkpoints; 0 = only on demand"
    )
    keep_checkpoints: int = Field(
        4,
        ge=1,
        le=1000,
        description="newest checkpoints kept, plus always the newest healthy one; "
        "(keep - 1) x checkpoint_every must cover the policy's rollback distance + detection_delay_steps",
    )
    detection_delay_steps: int = Field(
        25,
        ge=0,
        description="steps from an incident's onset to the rollback that answers it "
        "(patience + pipeline lag): the kept checkpoints must reach this much further back",
    )
    preset: str | None = Field(
        None,
        description="the run's model profile (small, medium, large; see `spikeguard presets`); "
        "None: SPIKEGUARD_PRESET if set",
    )
    policy: dict[str, Any] = Field(
        default_factory=dict, description="the run's PolicyConfig overrides, over the preset's"
    )
    async_checkpoint: bool = Field(
        True,
        description="write checkpoints on a background thread (the step only copies the state "
        "to CPU memory); at most one write in flight, a save due meanwhile waits for it",
    )
    resume: ResumeMode = Field(
        ResumeMode.AUTO,
        description="auto: resume an unfinished run of this run_id, start a finished "
        "one afresh (its files moved aside); must: resume or raise; never: always start from step 0 "
        "(earlier files moved aside). One WARNING line says what happened. true/false mean auto/never",
    )
    mode: GuardMode = Field(
        GuardMode.PROTECT,
        description="protect: apply what the pipeline decides; observe: log, report "
        "and count what it would do, apply nothing (a first run); skip-only: only the Guard's own "
        "update skips",
    )
    loggers: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="also send every action taken or withheld to TensorBoard "
        "(needs the tensorboard package; SummaryWriter's default runs/ directory) and/or the active "
        "W&B run (wandb.log, spikeguard/ keys); a missing one is said once and skipped",
    )
    max_skip_share: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="recovery budget: the share of the run's steps whose data "
        "skip windows may skip; an action past it is refused with a WARNING (the pipeline alerts)",
    )
    max_rerun_share: float = Field(
        0.10,
        ge=0.0,
        le=1.0,
        description="recovery budget: the share of the run's steps rollbacks "
        "may re-run; a rollback past it is refused with a WARNING (the pipeline alerts)",
    )
    recovery_min_steps: int = Field(
        400,
        ge=0,
        description="recovery budget floor: re-running or skipping up to this many steps "
        "(each) is always within budget, however short the run; one recovery of the default policy "
        "(a rollback at least 100 steps before the onset, the window from the onset plus 4 "
        "batches skipped) fits it, so the budget bounds repeated recoveries, not the first one",
    )
    max_grad_norm: float | None = Field(
        None,
        gt=0.0,
        description="the Guard clips gradients at this total norm after measuring them "
        "(use it instead of your own clip_grad_norm_ before guard.step, which would hide the true "
        "norm from the detectors); None: no clipping of the Guard's own unless an action asks",
    )
    unprotected_after_s: float = Field(
        30.0,
        gt=0,
        description="a published step the pipeline has not judged (no signed pulse from "
        "the actuator) for this long makes the run unprotected: one WARNING naming the likely causes "
        "and spikeguard_trainer_unprotected=1; training goes on with the local protections",
    )
    top_k_layers: int = Field(
        5, ge=0, le=64, description="largest per-parameter gradient norms reported per step"
    )
    param_norm: bool = Field(
        False,
        description="report the total parameter norm (one norm pass over the parameters, on "
        "device, read with the step's statistics); off by default: no default detector reads it",
    )
    update_norm: bool = Field(
        False,
        description="off by default (no default detector reads it, and on the measured runs "
        "it warned no earlier than the LR does: docs/detection.md); report the norm of the parameter "
        "change each optimizer step made "
        "(producers/update_norm.py): costs one device copy of the parameters (this rank's shards) "
        "and three passes over them per step, no extra device-to-host transfer; the event of step s "
        "carries step s-1's update, 0 when that update was skipped",
    )
    skip_nonfinite: bool = Field(
        True, description="skip the optimizer update at once on a non-finite loss or gradient"
    )
    incident_window: int = Field(
        10,
        ge=0,
        description="checkpoints within this many steps of a non-finite value are unhealthy",
    )
    healthy_stretch: int = Field(
        25,
        ge=0,
        description="finite steps needed after an anomaly action before checkpoints count as healthy",
    )
    clip_beta: float = Field(
        0.98,
        gt=0.0,
        lt=1.0,
        description="EMA decay of the gradient-norm baseline (adaptive clipping)",
    )
    clip_warmup: int = Field(
        25, ge=1, description="gradient norms observed before adaptive clipping may clip"
    )
    clip_track_z: float = Field(
        6.0,
        gt=0.0,
        description="norms above mean + this many std teach the baseline only up to that bound",
    )
    queue_size: int = Field(
        10_000, ge=1, description="events buffered for the bus; beyond it the oldest are dropped"
    )
    flush_timeout: float = Field(
        5.0, ge=0.0, description="seconds close() waits for buffered events to go out"
    )
    signing_key: SecretStr | None = Field(
        None, description="HMAC key; when set, unsigned or badly signed actions are refused"
    )
    publish_all_ranks: bool = Field(
        False, description="every rank publishes StepEvents (default: rank 0 only)"
    )
    lockstep: bool = Field(
        False,
        description="wait after each step until the pipeline has decided it and the actuator "
        "has published what it does about it (reproducible demos and tests: every action lands "
        "at the step it is due; blocks training, never use it for real runs)",
    )
    lockstep_timeout: float = Field(
        10.0,
        gt=0.0,
        description="longest wait for one step's decision, or for the actuator's pulse of it, "
        "in lockstep mode",
    )
    lockstep_settle: float = Field(
        0.05,
        ge=0.0,
        description="lockstep with an actuator that does not pulse each decision of a lockstep "
        "run: how long an anomalous decision's actions are awaited",
    )
    data_seed: int | None = Field(
        None,
        description="seed of the data order, independent of the global RNG; None (the default): "
        "the order the loader draws itself, as it would unguarded (kept per data epoch, so "
        "rollbacks and resumes read it again)",
    )
    history_steps: int = Field(
        4096, ge=16, description="recent steps whose batch index is remembered (for skips)"
    )
    verify_reruns: int = Field(
        0,
        ge=0,
        le=1,
        description="re-run a non-finite or outlier step once from the same state to tell "
        "a flaky device (transient: the re-run's update applied when its values are clean, else "
        "skipped; no rollback) from bad data (reproducible); needs "
        "guard.step(loss, closure=...); costs one forward+backward per such step (producers/rerun.py)",
    )
    provenance_window: int = Field(
        512, ge=16, description="recent steps whose sample ids are kept for incident forensics"
    )
    max_applied_ids: int = Field(
        10_000, ge=16, description="applied action ids remembered (oldest forgotten first)"
    )
    # The local skip-step rule (producers/skip_rule.py). Its thresholds are the outlier
    # model's, shared with the pipeline's level test (processors/outlier_model.py): calibrated
    # per run to a false-alarm rate, so they are not settings of the Guard.
    skip_outliers: bool = Field(
        True, description="skip the update of an isolated outlier step at once (local rule)"
    )
    skip_max_run: int = Field(
        2,
        ge=1,
        description="outliers in a row still skipped; a longer run is not isolated, and "
        "is left to the pipeline (the rule then learns it)",
    )

    @model_validator(mode="before")
    @classmethod
    def _resume_from_bool(cls, data: Any) -> Any:
        # resume=True/False predates the three modes: True resumed (auto), False started over.
        if isinstance(data, dict) and "resume" in data:
            value = data["resume"]
            text = value.strip().lower() if isinstance(value, str) else None
            if value is True or text in ("true", "1", "yes"):
                data = dict(data, resume=ResumeMode.AUTO)
            elif value is False or text in ("false", "0", "no"):
                data = dict(data, resume=ResumeMode.NEVER)
        return data
