"""Pydantic v2 models of every record on the bus.

Non-finite floats are the point of this system and JSON has none, so they
travel as the strings "NaN", "Infinity", "-Infinity" and parse back to floats
(``ser_json_inf_nan="strings"``). Every record carries ``schema_version``;
a reader refuses versions it does not know rather than guess at them.
"""

from __future__ import annotations

import math
import time
from enum import Enum
from typing import Annotated, Any, ClassVar, Final, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from spikeguard.schemas.actions import ActionKind, AnyParams, document_params, tag_params

SCHEMA_VERSION: Final = 1

# A run id becomes a Kafka key and a metric label value: keep it short and printable.
RunId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\s\x00-\x1f]+$")]
# Counters (steps, epochs, ranks, data positions) stay below 2**53: every JSON
# reader holds them exactly (JavaScript, jq and float64 columns round above
# it), and a step of 10**29 is never a trainer's but a forged or corrupt record.
MAX_COUNTER = 2**53 - 1
Step = Annotated[int, Field(ge=0, le=MAX_COUNTER)]
# A rollback makes a run repeat step numbers; the epoch (number of rollbacks
# applied so far) tells a re-run step from a late duplicate of the original.
Epoch = Annotated[
    int, Field(ge=0, le=MAX_COUNTER, description="rollbacks applied before this record")
]
# A trainer session: the nonce a Guard draws when it starts (schemas.ids.new_session), fixed-width
# hex whose order is the order the sessions started in.
Session = Annotated[
    str | None,
    Field(
        min_length=8,
        max_length=64,
        pattern=r"^[0-9a-f]+$",
        description="the trainer session the record belongs to (schemas.ids.new_session): "
        "signed with it, so a genuine record of another session, replayed, moves nothing",
    ),
]
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _non_finite_from_text(value: object) -> object:
    # In a free-form map a float has no declared type to coerce to, so the
    # strings JSON carries non-finite floats as are turned back here.
    return _NON_FINITE.get(value, value) if isinstance(value, str) else value


# Small free-form maps (signals, action parameters) keep scalar values only.
Scalar = Annotated[Union[float, int, str, bool, None], BeforeValidator(_non_finite_from_text)]


class _Event(BaseModel):
    model_config = ConfigDict(
        extra="ignore",  # a newer writer's extra fields do not break an older reader
        frozen=True,
        ser_json_inf_nan="strings",
        use_enum_values=False,
    )

    schema_version: Literal[1] = SCHEMA_VERSION


class AnomalyType(str, Enum):
    """What went wrong. Ordered loosely from most to least urgent."""

    NONE = "none"
    NON_FINITE = "non_finite"
    EXTREME_LOSS = "extreme_loss"
    GRADIENT_EXPLOSION = "gradient_explosion"
    LOSS_SPIKE = "loss_spike"
    DIVERGENCE = "divergence"
    OSCILLATION = "oscillation"
    # A sustained rise above the run's best level over thousands of steps.
    SLOW_RISE = "slow_rise"
    LR_OUT_OF_BOUNDS = "lr_out_of_bounds"
    # The loss (or the gradient norm) rose beyond its noise after the LR jumped beyond any rate
    # the run had trained at (no warm restart): the LR caused it, the data is fine.
    LR_INDUCED_RISE = "lr_induced_rise"
    LOSS_SCALE_COLLAPSE = "loss_scale_collapse"
    BAD_BATCH = "bad_batch"
    ML_OUTLIER = "ml_outlier"
    # One layer's share of the gradient norm far above its own baseline (the ml detector).
    LAYER_BLOWUP = "layer_blowup"
    # One isolated step far out (a bad batch): the guard's local skip answers it, never a rollback.
    OUTLIER_STEP = "outlier_step"
    # Predictor warnings: preventive, never a rollback on their own.
    INSTABILITY_WARNING = "instability_warning"
    STALLED = "stalled"
    LR_TOO_HIGH = "lr_too_high"
    # A mechanism signal, not the loss: the attention logits grew far beyond the run's own
    # level (the softmax collapses onto one key before the loss spikes).
    ATTENTION_LOGIT_GROWTH = "attention_logit_growth"


class HealthLevel(str, Enum):
    EXCELLENT = "excellent"
    GOOD = "good"
    WARNING = "warning"
    CONCERNING = "concerning"
    CRITICAL = "critical"


class Urgency(str, Enum):
    NONE = "none"
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    CRITICAL = "critical"


class AckStatus(str, Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # this action_id was applied before
    REJECTED = "rejected"  # bad or missing signature, or not for this run
    UNHANDLED = "unhandled"  # no handler for this kind
    FAILED = "failed"  # the handler raised


#: How a REJECTED ack's result starts when the trainer withheld the action on purpose (observe
#: or skip-only mode, the recovery budget): it will withhold what follows too, a stop included.
WITHHELD = "not applied: "


class BatchStats(BaseModel):
    """Optional statistics of the batch that produced a step."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="strings", extra="ignore")

    size: int = Field(0, ge=0)
    nan_inputs: int = Field(0, ge=0)
    inf_inputs: int = Field(0, ge=0)
    outliers: int = Field(0, ge=0, description="inputs beyond the outlier threshold")
    max_label_fraction: float | None = Field(
        None, ge=0.0, le=1.0, description="share of the most frequent label"
    )


class StepEvent(_Event):
    """One optimizer step of one rank of one run, as the trainer saw it."""

    #: Fields added since steps were first signed: in the signed payload only when set
    #: (schemas.signing), so a one-rank run's signed steps verify with readers that predate them.
    signed_when_set: ClassVar[frozenset[str]] = frozenset(
        {"loss_mean", "loss_ranks", "session", "attention_logit_max", "update_ratio"}
    )

    run_id: RunId
    session: Session = None
    step: Step
    epoch: Epoch = 0
    rank: int = Field(0, ge=0, le=MAX_COUNTER)
    time: float = Field(default_factory=time.time, description="unix seconds")
    loss: float
    loss_mean: float | None = Field(
        None,
        description="with several ranks: the mean of the ranks' losses (the global batch's loss)",
    )
    loss_ranks: int | None = Field(
        None,
        ge=1,
        le=MAX_COUNTER,
        description="with several ranks: how many; `loss` is then the "
        "largest of their losses, so a spike in any rank's data is a spike of the run",
    )
    grad_norm: float | None = Field(None, description="total L2 norm before clipping")
    lr: float | None = None
    loss_scale: float | None = Field(None, description="fp16 GradScaler scale, if any")
    update_norm: float | None = Field(
        None,
        description="L2 norm of the parameter change made by the previous optimizer step "
        "(the one that produced the parameters this step's loss was computed at); 0 when that "
        "update was skipped; none at a run's first step or after a rollback",
    )
    param_norm: float | None = Field(None, description="L2 norm of the parameters at this step")
    # Mechanism signals (producers/signals), sent only by a trainer that opted in.
    attention_logit_max: float | None = Field(
        None,
        description="the largest attention logit q·kᵀ/√head_dim over every layer, head and "
        "visible pair of this step's forward (Wortsman et al. 2023's attention-logit growth)",
    )
    update_ratio: float | None = Field(
        None,
        description="the largest per-layer ‖θ_after − θ_before‖ / ‖θ_before‖ of this step's "
        "update (0 when it was skipped)",
    )
    top_grad_norms: dict[str, float] = Field(
        default_factory=dict, description="largest per-layer gradient norms"
    )
    nonfinite_grads: int = Field(0, ge=0, description="gradient elements that were NaN/Inf")
    update_skipped: bool = Field(False, description="the trainer skipped this update itself")
    skip_reason: Literal["non_finite", "outlier_step", "scaler_overflow", "transient"] | None = (
        Field(
            None,
            description="why the update was skipped: a non-finite loss or gradient, the Guard's local "
            "outlier rule, the fp16 GradScaler's own overflow check (normal, not an anomaly), or a "
            "re-run that came out different (a suspected hardware fault; the values are the re-run's)",
        )
    )
    rerun: Literal["transient", "reproducible"] | None = Field(
        None,
        description="the Guard re-ran this suspicious step once (verify_reruns=1): did it differ?",
    )
    overflow_streak: int = Field(
        0,
        ge=0,
        description="consecutive GradScaler overflow skips up to this step, each one "
        "lowering the loss scale (0 when this step's update was not an overflow skip)",
    )
    batch_index: int | None = Field(None, ge=0, le=MAX_COUNTER, description="global data position")
    batch: BatchStats | None = None
    signature: str | None = Field(
        None, description="hex HMAC-SHA256 by the trainer with the run's key, see schemas.signing"
    )

    @property
    def finite(self) -> bool:
        """True when loss and gradient norm are both finite (or absent)."""
        return math.isfinite(self.loss) and (
            self.grad_norm is None or math.isfinite(self.grad_norm)
        )


class Verdict(_Event):
    """One detector's judgement of one step."""

    #: Added since verdicts were first signed: in the signed payload only when set.
    signed_when_set: ClassVar[frozenset[str]] = frozenset({"session"})

    run_id: RunId
    session: Session = None  # the judged step's
    step: Step
    epoch: Epoch = 0
    detector: str = Field(min_length=1, max_length=64)
    is_anomaly: bool
    type: AnomalyType = AnomalyType.NONE
    confidence: float = Field(0.0, ge=0.0, le=1.0)
    critical: bool = Field(False, description="decides on its own, whatever the others say")
    rules: list[str] = Field(default_factory=list, description="names of what fired")
    message: str = ""
    signals: dict[str, Scalar] = Field(default_factory=dict)
    # The judged step's own values, so fusion can show what a decision rests on.
    loss: float | None = Field(None, description="the step's loss, as the trainer published it")
    grad_norm: float | None = Field(None, description="the step's gradient norm, if published")
    # Predictor fields: the early warning.
    instability_probability: float | None = Field(None, ge=0.0, le=1.0)
    horizon_steps: int | None = Field(None, ge=1)
    health: HealthLevel | None = None
    signature: str | None = Field(
        None,
        max_length=128,
        description="hex HMAC-SHA256 by the detector worker, see schemas.signing "
        "(optional on the wire; "
        "a consumer with the key refuses a record without it)",
    )


#: How many verdicts one StepVerdicts record may carry (a worker hosts a handful of detectors).
MAX_STEP_VERDICTS = 32


class StepVerdicts(_Event):
    """Every verdict a co-hosted detector worker gave one step, as one record.

    ``spikeguard worker detectors`` publishes one of these per step on the
    ``step-verdicts`` topic instead of one :class:`Verdict` per detector on
    ``verdicts``: fusion decodes and authenticates one record per step, not
    one per detector. The record is signed as a whole by the detector worker;
    the verdicts inside carry no signature of their own. Fusion reads both
    topics, so independent detector workers (one verdict each) keep working.
    """

    run_id: RunId
    step: Step
    epoch: Epoch = 0
    verdicts: list[Verdict] = Field(min_length=1, max_length=MAX_STEP_VERDICTS)
    signature: str | None = Field(
        None,
        max_length=128,
        description="hex HMAC-SHA256 by the detector worker over the whole "
        "record, verdicts included, see schemas.signing (a consumer with the key refuses a record "
        "without it)",
    )

    @model_validator(mode="after")
    def _one_step(self) -> "StepVerdicts":
        # Fusion files each verdict under its own run, step and detector: a record whose
        # verdicts speak of another step, or twice for one detector, is refused whole.
        names = set()
        for verdict in self.verdicts:
            if (verdict.run_id, verdict.step, verdict.epoch) != (
                self.run_id,
                self.step,
                self.epoch,
            ):
                raise ValueError(
                    f"a verdict of {verdict.detector} is for run {verdict.run_id} step {verdict.step} "
                    f"epoch {verdict.epoch}, not the record's run {self.run_id} step {self.step} "
                    f"epoch {self.epoch}"
                )
            if verdict.detector in names:
                raise ValueError(f"two verdicts of detector {verdict.detector} for one step")
            names.add(verdict.detector)
        return self


class Evidence(BaseModel):
    """What a decision rests on: the step's own values next to what is normal for the run.

    Fusion fills it from the verdicts (the values) and its own record of the
    run's healthy steps (the baselines); the policy copies it into every action
    it derives, so a trainer can check an action against what it published.
    """

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="strings", extra="ignore")

    step: Step
    epoch: Epoch = 0
    loss: float | None = None
    grad_norm: float | None = None
    loss_baseline: float | None = Field(
        None, description="median loss of the run's recent healthy steps (None: too few yet)"
    )
    grad_norm_baseline: float | None = Field(
        None, description="median gradient norm of the run's recent healthy steps"
    )


class Claim(BaseModel):
    """What the decision behind an action said: which step (and epoch) was what.

    The recovery policy copies it from the decision into every action it
    derives; the trainer applies a state-changing action only if the action's
    evidence is of this very step and its own statistics agree the step was
    anomalous for this type (producers/evidence.py). An action without a claim
    is a key holder's own command (an operator's), checked against its
    evidence only.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    step: Step = Field(description="the step the decision was about")
    epoch: Epoch = 0
    type: AnomalyType = Field(AnomalyType.NONE, description="what the decision said the step was")


class Decision(_Event):
    """Fusion's one decision for one (run_id, step): the pipeline's verdict on it.

    Fusion owns everything here, criticality and incident grouping included;
    what to do about it is the recovery policy's business alone.
    """

    #: Added since decisions were first signed: in the signed payload only when set.
    signed_when_set: ClassVar[frozenset[str]] = frozenset({"session"})

    decision_id: str
    run_id: RunId
    session: Session = None  # the decided step's: the actions derived from it carry it
    step: Step
    epoch: Epoch = 0
    is_anomaly: bool
    type: AnomalyType = AnomalyType.NONE
    confidence: float = Field(0.0, ge=0.0, le=1.0)
    critical: bool = Field(
        False,
        description="a critical anomaly (non-finite values, extreme loss, a detector "
        "sure on its own): decided at once, answered at once",
    )
    urgency: Urgency = Field(Urgency.NONE, description="for people and dashboards")
    preventive: bool = Field(False, description="an early warning, not an anomaly")
    incident_id: str | None = None
    incident_onset_step: int | None = Field(None, ge=0, le=MAX_COUNTER)
    detectors: dict[str, float] = Field(
        default_factory=dict, description="confidence of each detector that spoke"
    )
    flagged_by: dict[str, AnomalyType] = Field(
        default_factory=dict, description="what each detector that flagged the step said it was"
    )
    missing: list[str] = Field(default_factory=list, description="detectors that did not speak")
    rules: list[str] = Field(default_factory=list)
    signals: dict[str, Scalar] = Field(default_factory=dict)
    evidence: Evidence | None = None
    signature: str | None = Field(
        None,
        max_length=128,
        description="hex HMAC-SHA256 by fusion, see schemas.signing (optional on the wire; "
        "a consumer with the key refuses a record without it)",
    )


class Action(_Event):
    """A command for the trainers of one run, applied at ``apply_at_step``.

    ``params`` is the typed parameter model of ``kind`` (:mod:`.actions`); a
    plain dict is accepted and parsed into it.
    """

    #: Added since actions were first signed: in the signed payload only when set.
    signed_when_set: ClassVar[frozenset[str]] = frozenset({"incident_onset_step", "session"})

    action_id: str
    run_id: RunId
    session: Session = None
    kind: ActionKind
    apply_at_step: Step = Field(description="every rank applies it at this step")
    params: AnyParams
    decision_id: str | None = None
    incident_id: str | None = None
    incident_onset_step: int | None = Field(
        None,
        ge=0,
        le=MAX_COUNTER,
        description="the incident's first anomalous step, as fusion found it: the trainer keeps "
        "the incident's samples and pre-onset checkpoint around it",
    )
    evidence: Evidence | None = Field(
        None, description="what the decision rested on, for the trainer to check"
    )
    claim: Claim | None = Field(
        None, description="the decided step and its anomaly type, for the trainer to check"
    )
    reason: str = ""
    signature: str | None = Field(None, description="hex HMAC-SHA256, see schemas.signing")

    @model_validator(mode="before")
    @classmethod
    def _tag(cls, data: object) -> object:
        return tag_params(data)

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The schema of the wire format: ``params`` chosen by ``kind``, the tag not repeated."""
        schema = super().model_json_schema(*args, **kwargs)
        document_params(schema)
        return schema

    @model_validator(mode="after")
    def _params_match_kind(self) -> "Action":
        if self.params.kind is not self.kind:
            raise ValueError(
                f"params of {self.params.kind.value} given to a {self.kind.value} action"
            )
        return self


class Ack(_Event):
    """A trainer's answer to an action."""

    #: Added since these were first signed: in the signed payload only when set.
    signed_when_set: ClassVar[frozenset[str]] = frozenset({"session"})

    run_id: RunId
    session: Session = None
    action_id: str
    kind: ActionKind
    status: AckStatus
    step: Step = Field(description="the step at which it was applied or refused")
    rank: int = Field(0, ge=0)
    result: str = ""
    time: float = Field(default_factory=time.time)
    signature: str | None = Field(
        None,
        max_length=128,
        description="hex HMAC-SHA256 by the run's trainer, see schemas.signing "
        "(optional on the wire; "
        "a consumer with the key refuses a record without it)",
    )


class CheckpointEvent(_Event):
    """A checkpoint the trainer wrote."""

    #: Added since these were first signed: in the signed payload only when set.
    signed_when_set: ClassVar[frozenset[str]] = frozenset({"session"})

    run_id: RunId
    session: Session = None
    step: Step
    epoch: Epoch = 0
    checkpoint_id: str
    path: str = ""
    healthy: bool = Field(description="the run was healthy when it was taken")
    batch_index: int | None = Field(None, ge=0)
    reason: Literal["periodic", "on_demand", "emergency", "final"] = "periodic"
    deleted: bool = Field(
        False, description="the trainer has removed this checkpoint: no longer a rollback target"
    )
    time: float = Field(default_factory=time.time)
    signature: str | None = Field(
        None,
        max_length=128,
        description="hex HMAC-SHA256 by the run's trainer, see schemas.signing "
        "(optional on the wire; "
        "a consumer with the key refuses a record without it)",
    )


class DeadLetter(_Event):
    """A record a consumer could not process, with the reason."""

    source_topic: str
    partition: int | None = None
    offset: int | None = None
    key: str | None = None
    value: str = Field(description="the record as text (undecodable bytes escaped), truncated")
    value_bytes: int = Field(0, ge=0, description="the record's full size")
    error: str = Field(description="the exception class")
    reason: str
    consumer: str = ""
    time: float = Field(default_factory=time.time)

    @field_validator("value")
    @classmethod
    def _truncate(cls, value: str) -> str:
        return value if len(value) <= 4096 else value[:4096] + "…"


class RunEvent(_Event):
    """A run's start or end, with the settings it runs under (the compacted ``runs`` topic, keyed by run_id).

    Both records carry the full settings: on a compacted topic the end replaces the
    start, and a consumer that (re)starts late still learns the run's policy.
    """

    #: Added since these were first signed: in the signed payload only when set.
    signed_when_set: ClassVar[frozenset[str]] = frozenset({"session", "lockstep"})

    run_id: RunId
    session: Session = None
    kind: Literal["start", "end"]
    preset: str | None = Field(None, description="model profile (actuators/presets.py), if any")
    policy: dict[str, Any] = Field(
        default_factory=dict, description="PolicyConfig overrides over the preset's values"
    )
    fusion: dict[str, Any] = Field(
        default_factory=dict,
        description="FusionConfig overrides over the fusion stage's own settings",
    )
    checkpoint_every: int = Field(
        0, ge=0, description="steps between periodic checkpoints; 0 = on demand"
    )
    keep_checkpoints: int = Field(1, ge=1)
    detection_delay_steps: int = Field(0, ge=0)
    planned_steps: int | None = Field(
        None, ge=0, description="the run's planned optimizer steps, if known"
    )
    step: Step = Field(
        0, description="start: the first step (after a resume); end: the last step + 1"
    )
    epoch: Epoch = 0
    finished: bool = Field(
        False, description="end: the run completed its plan (it will not be resumed)"
    )
    reason: str = ""
    lockstep: bool | None = Field(
        None,
        description="true: the trainer waits for each step's judgement (lockstep mode), so the "
        "actuator pulses every decision of the run, after its actions",
    )
    time: float = Field(default_factory=time.time)
    # Optional on the wire (a record without it still decodes); a stage with the key refuses it.
    signature: str | None = Field(
        None, description="hex HMAC-SHA256 of the run's key, see schemas.signing"
    )


EVENT_TYPES: tuple[type[_Event], ...] = (
    StepEvent,
    Verdict,
    StepVerdicts,
    Decision,
    Action,
    Ack,
    CheckpointEvent,
    DeadLetter,
    RunEvent,
)
