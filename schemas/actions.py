"""The parameters of each action kind, as typed models: one definition for both ends.

The policy builds them, the trainer applies them (``producers/actions.py``) and
``spikeguard schemas`` prints them; ``Action.params`` is a union of these models
discriminated by ``kind``. On the wire the tag is the action's own ``kind`` (it
is not repeated inside ``params``), so an action reads
``{"kind": "scale_lr", "params": {"factor": 0.5}, ...}``.

Two kinds of checks, on purpose:

- *shape* (names, types, required parameters) is checked when an action is
  parsed: a record with a missing or mistyped parameter is malformed, and the
  trainer's inbox sends it to the DLQ with the reason;
- *values* (a factor is a finite number > 0, an index is >= 0) are declared on
  the fields too (they show in the JSON Schema) but checked by :meth:`check`
  when the trainer applies the action, so a signed action with a bad value
  still gets an answer: a FAILED ack that says which parameter and why.

Parameters also read like the plain dict they once were (``params["factor"]``,
``dict(params)``, ``params.get("z")``), so handlers written against dicts keep
working.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Iterator, Literal, Union

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field


class ActionKind(str, Enum):
    """What an action does; each kind's parameters are the model of that name below."""

    ROLLBACK = "rollback"
    SKIP_BATCHES = "skip_batches"
    SET_LR = "set_lr"
    SCALE_LR = "scale_lr"
    RESTORE_LR = "restore_lr"
    HOLD_LR = "hold_lr"  # hold jumps of the schedule at the highest LR trained at
    CLIP = "clip"
    CHECKPOINT = "checkpoint"
    STOP = "stop"
    REDUCE_BATCH_SIZE = "reduce_batch_size"  # a user handler applies it
    SET_EPS = "set_eps"  # a user handler applies it
    ALERT = "alert"  # informational
    # Rescale the attention heads whose max logit passes a threshold (a trainer that measures
    # the logits applies it: producers/signals/prevention.py).
    QK_CLIP = "qk_clip"
    # The pipeline judged the run up to a step: the trainer's inbox notes it, the training
    # thread never sees it (producers/protection.py).
    PULSE = "pulse"


K = ActionKind


def _positive(description: str, default: Any = ...) -> Any:
    return Field(default, description=description, json_schema_extra={"exclusiveMinimum": 0})


def _index(description: str, default: Any = ...) -> Any:
    return Field(default, description=description, json_schema_extra={"minimum": 0})


class ActionParams(BaseModel):
    """What every kind's parameters share: the tag, read-only dict access, the value check."""

    model_config = ConfigDict(extra="ignore", frozen=True, ser_json_inf_nan="strings")

    kind: ActionKind = Field(exclude=True, repr=False)

    def check(self) -> None:
        """Raise ValueError naming the first parameter whose value the trainer cannot apply."""
        for name, field in type(self).model_fields.items():
            bounds = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            value = getattr(self, name)
            if value is None or not bounds:
                continue
            if "exclusiveMinimum" in bounds and not (math.isfinite(value) and value > 0):
                raise ValueError(f"parameter {name!r} must be a finite number > 0, got {value!r}")
            if "minimum" in bounds and value < 0:
                raise ValueError(f"parameter {name!r} must be >= 0, got {value!r}")

    # -- read like a dict: the parameters that are set ----------------------------------
    def keys(self) -> list[str]:
        return [n for n in type(self).model_fields if n != "kind" and getattr(self, n) is not None]

    def __getitem__(self, name: str) -> Any:
        if name not in self.keys():
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self.keys() else default

    def __contains__(self, name: object) -> bool:
        return name in self.keys()

    def items(self) -> Iterator[tuple[str, Any]]:
        return ((n, getattr(self, n)) for n in self.keys())


class RollbackParams(ActionParams):
    kind: Literal[K.ROLLBACK] = Field(K.ROLLBACK, exclude=True, repr=False)
    target_step: int = _index("roll back to the newest healthy checkpoint at or before this step")
    checkpoint_id: str | None = Field(None, description="the checkpoint the policy chose, if any")


class SkipBatchesParams(ActionParams):
    kind: Literal[K.SKIP_BATCHES] = Field(K.SKIP_BATCHES, exclude=True, repr=False)
    from_step: int = _index("first step whose batch is skipped")
    to_step: int = _index("last step whose batch is skipped (inclusive)")
    extra: int = _index("batches skipped beyond the last one", 0)

    def check(self) -> None:
        super().check()
        if self.to_step < self.from_step:
            raise ValueError(f"skip window runs backwards: {self.from_step}..{self.to_step}")


class SetLrParams(ActionParams):
    kind: Literal[K.SET_LR] = Field(K.SET_LR, exclude=True, repr=False)
    lr: float = _positive("the learning rate to use from now on")


class ScaleLrParams(ActionParams):
    kind: Literal[K.SCALE_LR] = Field(K.SCALE_LR, exclude=True, repr=False)
    factor: float = _positive("multiply the learning rate by this")


class RestoreLrParams(ActionParams):
    kind: Literal[K.RESTORE_LR] = Field(K.RESTORE_LR, exclude=True, repr=False)
    factor: float = _positive("raise the learning rate by this, never above its base")


class HoldLrParams(ActionParams):
    """From now on a jump of the schedule above the highest LR an update was applied at is held
    there until the schedule falls back to it (sent with a rollback past an LR blow-up)."""

    kind: Literal[K.HOLD_LR] = Field(K.HOLD_LR, exclude=True, repr=False)


class ClipParams(ActionParams):
    """Clipping switched on or tightened (never loosened), or, with ``mode="lift"``, the clipping
    a recovery set given back once its cause is gone. A trainer that predates ``lift`` refuses
    such a record as malformed (an unknown mode), to the DLQ with the reason: it never reads it
    as a clip to tighten."""

    kind: Literal[K.CLIP] = Field(K.CLIP, exclude=True, repr=False)
    mode: Literal["adaptive", "lift"] | None = Field(
        None,
        description="adaptive: clip at z robust deviations; lift: give back the clipping actions "
        "set, to max_norm if given, else to none but the trainer's own max_grad_norm; absent: "
        "clip at a fixed max_norm",
    )
    max_norm: float | None = _positive(
        "global gradient-norm limit (mode max_norm); mode lift: the limit to go back to", None
    )
    z: float | None = _positive("deviations above the running median (mode adaptive)", None)

    def check(self) -> None:
        super().check()
        if self.mode == "lift":
            return  # (max_norm optional: absent, no clipping but the trainer's own)
        needed = "z" if self.mode == "adaptive" else "max_norm"
        if getattr(self, needed) is None:
            raise ValueError(f"missing parameter {needed!r} (mode {self.mode or 'max_norm'})")

    @property
    def lifts(self) -> bool:
        """Whether this gives clipping back rather than setting it."""
        return self.mode == "lift"


class CheckpointParams(ActionParams):
    kind: Literal[K.CHECKPOINT] = Field(K.CHECKPOINT, exclude=True, repr=False)
    reason: Literal["on_demand", "emergency"] = Field(
        "on_demand", description="emergency: taken during trouble, never a rollback target"
    )


class StopParams(ActionParams):
    kind: Literal[K.STOP] = Field(K.STOP, exclude=True, repr=False)
    reason: str = Field("", description="why the run is stopped (the action's reason if empty)")


class ReduceBatchSizeParams(ActionParams):
    kind: Literal[K.REDUCE_BATCH_SIZE] = Field(K.REDUCE_BATCH_SIZE, exclude=True, repr=False)
    factor: float = _positive("multiply the batch size by this (a user handler applies it)")


class SetEpsParams(ActionParams):
    kind: Literal[K.SET_EPS] = Field(K.SET_EPS, exclude=True, repr=False)
    eps: float = _positive("the optimizer's new eps (a user handler applies it)")


class AlertParams(ActionParams):
    kind: Literal[K.ALERT] = Field(K.ALERT, exclude=True, repr=False)
    severity: str = Field("info", description="info, warning or critical")
    message: str = ""


class QkClipParams(ActionParams):
    kind: Literal[K.QK_CLIP] = Field(K.QK_CLIP, exclude=True, repr=False)
    threshold: float = _positive(
        "from now on, after every update, a head whose max attention logit (as the trainer "
        "measures it) passed this has its query and key rows rescaled so that it returns to it"
    )


class PulseParams(ActionParams):
    kind: Literal[K.PULSE] = Field(K.PULSE, exclude=True, repr=False)
    judged_step: int = _index("the newest step of the run the pipeline has decided")
    epoch: int = _index("that step's epoch", 0)


PARAMS: dict[ActionKind, type[ActionParams]] = {
    cls.model_fields["kind"].default: cls
    for cls in (
        RollbackParams,
        SkipBatchesParams,
        SetLrParams,
        ScaleLrParams,
        RestoreLrParams,
        HoldLrParams,
        ClipParams,
        CheckpointParams,
        StopParams,
        ReduceBatchSizeParams,
        SetEpsParams,
        AlertParams,
        QkClipParams,
        PulseParams,
    )
}
assert set(PARAMS) == set(ActionKind), "every action kind has its parameters"

AnyParams = Annotated[
    Union[
        RollbackParams,
        SkipBatchesParams,
        SetLrParams,
        ScaleLrParams,
        RestoreLrParams,
        HoldLrParams,
        ClipParams,
        CheckpointParams,
        StopParams,
        ReduceBatchSizeParams,
        SetEpsParams,
        AlertParams,
        QkClipParams,
        PulseParams,
    ],
    Field(discriminator="kind"),
]


def tag_params(data: Any) -> Any:
    """An action's raw fields with its ``kind`` copied into ``params``, where the union looks."""
    if not isinstance(data, dict):
        return data
    params = data.get("params")
    if params is None:
        params = {}
    if isinstance(params, dict) and "kind" not in params and "kind" in data:
        kind = data["kind"]
        return {
            **data,
            "params": {**params, "kind": kind.value if isinstance(kind, ActionKind) else kind},
        }
    return data


def document_params(schema: dict[str, Any]) -> None:
    """The Action's JSON Schema as the wire has it: ``params`` chosen by the action's ``kind``."""
    defs = schema.get("$defs", {})
    for cls in PARAMS.values():
        props = defs.get(cls.__name__, {}).get("properties", {})
        props.pop("kind", None)
        required = defs.get(cls.__name__, {}).get("required")
        if required and "kind" in required:
            required.remove("kind")
    schema["properties"]["params"] = {
        "type": "object",
        "description": "the parameters of this kind (see allOf)",
    }
    schema["allOf"] = [
        {
            "if": {"properties": {"kind": {"const": kind.value}}},
            "then": {"properties": {"params": {"$ref": f"#/$defs/{cls.__name__}"}}},
        }
        for kind, cls in PARAMS.items()
    ]
