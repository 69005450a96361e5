"""Typed action parameters: one definition for the policy, the trainer and the JSON Schema."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from pydantic import ValidationError

from spikeguard.actuators import PolicyConfig, RecoveryPolicy
from spikeguard.errors import MalformedMessage
from spikeguard.schemas import (
    Action,
    ActionKind,
    AnomalyType,
    CheckpointEvent,
    Decision,
    decision_id,
    decode,
    encode,
    incident_id,
    json_schemas,
)
from spikeguard.schemas.actions import (
    PARAMS,
    AlertParams,
    ClipParams,
    RollbackParams,
    ScaleLrParams,
    SkipBatchesParams,
)
from spikeguard.schemas.signing import sign_action, verify_action

K = ActionKind

# One valid parameter set per kind, as the trainer reads them on the wire.
EXAMPLES: dict[ActionKind, dict] = {
    K.ROLLBACK: {"target_step": 400, "checkpoint_id": "ck-400"},
    K.SKIP_BATCHES: {"from_step": 401, "to_step": 500, "extra": 200},
    K.SET_LR: {"lr": 1e-3},
    K.SCALE_LR: {"factor": 0.5},
    K.RESTORE_LR: {"factor": 1.25},
    K.HOLD_LR: {},
    K.CLIP: {"mode": "adaptive", "z": 4.0},
    K.CHECKPOINT: {"reason": "emergency"},
    K.STOP: {"reason": "too many rollbacks"},
    K.REDUCE_BATCH_SIZE: {"factor": 0.5},
    K.SET_EPS: {"eps": 1e-7},
    K.ALERT: {"severity": "warning", "message": "watching"},
    K.QK_CLIP: {"threshold": 30.0},
    K.PULSE: {"judged_step": 120, "epoch": 1},
}


# And one that is wrong for the kind (some are another kind's parameters).
WRONG: dict[ActionKind, dict] = {
    K.ROLLBACK: EXAMPLES[K.SCALE_LR],
    K.SKIP_BATCHES: EXAMPLES[K.ROLLBACK],
    K.SET_LR: EXAMPLES[K.SCALE_LR],
    K.SCALE_LR: EXAMPLES[K.SET_LR],
    K.RESTORE_LR: EXAMPLES[K.SET_EPS],
    K.HOLD_LR: [],  # (it has no parameters: an object of any others is read as none)
    K.CLIP: {"z": "high"},
    K.CHECKPOINT: {"reason": "whenever"},
    K.STOP: {"reason": 7},
    K.REDUCE_BATCH_SIZE: EXAMPLES[K.SET_LR],
    K.SET_EPS: EXAMPLES[K.SCALE_LR],
    K.ALERT: {"severity": 1},
    K.QK_CLIP: EXAMPLES[K.SET_LR],
    K.PULSE: {"judged_step": "late"},
}


def make(kind: ActionKind, params: object) -> Action:
    return Action(action_id="a-1", run_id="r", kind=kind, apply_at_step=3, params=params)


def test_every_kind_has_a_model_and_an_example() -> None:
    assert set(PARAMS) == set(ActionKind) == set(EXAMPLES)


@pytest.mark.parametrize("kind", list(ActionKind))
def test_a_dict_becomes_the_kind_s_model_and_the_wire_does_not_repeat_the_tag(
    kind: ActionKind,
) -> None:
    action = make(kind, EXAMPLES[kind])
    assert type(action.params) is PARAMS[kind] and action.params.kind is kind
    assert dict(action.params) == EXAMPLES[kind]  # reads like the dict it was
    wire = json.loads(encode(action))
    assert "kind" not in wire["params"] and wire["kind"] == kind.value
    assert decode(encode(action), Action) == action
    signed = sign_action(action, "k")
    assert verify_action(decode(encode(signed), Action), "k")


@pytest.mark.parametrize("kind", list(ActionKind))
def test_the_json_schema_describes_the_wire(kind: ActionKind) -> None:
    schema = json_schemas()["Action"]
    wire = json.loads(encode(make(kind, EXAMPLES[kind])))
    jsonschema.validate(wire, schema)
    with pytest.raises(jsonschema.ValidationError):  # the schema is not a rubber stamp
        jsonschema.validate({**wire, "params": WRONG[kind]}, schema)


def test_every_action_the_policy_makes_matches_the_schema() -> None:
    schema = json_schemas()["Action"]
    policy = RecoveryPolicy(PolicyConfig(eps_actions=True, batch_size_actions=True), run_id="r")
    for step in (100, 200, 300, 400):
        policy.on_checkpoint(
            CheckpointEvent(run_id="r", step=step, checkpoint_id=f"ck-{step}", healthy=True)
        )
    actions = []
    for step in range(401, 520):
        kind = AnomalyType.NON_FINITE if step in (500, 510) else AnomalyType.NONE
        bad = kind is not AnomalyType.NONE
        actions += policy.on_decision(
            Decision(
                decision_id=decision_id("r", step),
                run_id="r",
                step=step,
                is_anomaly=bad,
                type=kind,
                confidence=1.0 if bad else 0.0,
                critical=bad,
                incident_id=incident_id("r", step) if bad else None,
                incident_onset_step=step if bad else None,
            )
        )
    assert {a.kind for a in actions} >= {
        K.ROLLBACK,
        K.SKIP_BATCHES,
        K.SCALE_LR,
        K.CLIP,
        K.REDUCE_BATCH_SIZE,
        K.SET_EPS,
    }
    for action in actions:
        jsonschema.validate(json.loads(encode(sign_action(action, "k"))), schema)


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"kind": "scale_lr", "params": {}}, "params.scale_lr.factor: Field required"),
        ({"kind": "rollback", "params": {"target_step": "soon"}}, "params.rollback.target_step"),
        ({"kind": "clip", "params": {"mode": "sometimes", "z": 2}}, "params.clip.mode"),
        ({"kind": "checkpoint", "params": {"reason": "whenever"}}, "params.checkpoint.reason"),
        ({"kind": "teleport", "params": {}}, "kind"),
    ],
)
def test_a_malformed_parameter_is_a_schema_error_that_names_it(raw: dict, words: str) -> None:
    record = {"action_id": "a-1", "run_id": "r", "apply_at_step": 3, **raw}
    with pytest.raises(MalformedMessage, match=words.replace(".", r"\.")):
        decode(json.dumps(record), Action)


def test_params_of_another_kind_are_refused() -> None:
    with pytest.raises(ValidationError, match="params of scale_lr given to a clip action"):
        make(K.CLIP, ScaleLrParams(factor=0.5))


@pytest.mark.parametrize(
    "params, words",
    [
        (ScaleLrParams(factor=-2.0), "'factor' must be a finite number > 0, got -2.0"),
        (ScaleLrParams(factor=math.nan), "'factor' must be a finite number > 0"),
        (RollbackParams(target_step=-1), "'target_step' must be >= 0"),
        (SkipBatchesParams(from_step=5, to_step=4), "skip window runs backwards: 5..4"),
        (ClipParams(mode="adaptive"), "missing parameter 'z'"),
        (ClipParams(), "missing parameter 'max_norm'"),
    ],
)
def test_values_are_checked_where_they_are_applied(params, words: str) -> None:
    make(params.kind, params)  # a well-formed action: it travels, and gets a FAILED ack
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        params.check()


def test_good_values_pass_the_check() -> None:
    for kind, raw in EXAMPLES.items():
        make(kind, raw).params.check()


def test_params_read_like_a_dict() -> None:
    p = make(K.ALERT, {"severity": "critical", "message": "stop"}).params
    assert isinstance(p, AlertParams)
    assert p["severity"] == "critical" and p.get("nothing", 1) == 1 and "message" in p
    clip = ClipParams(max_norm=1.0)
    assert dict(clip) == {"max_norm": 1.0} and clip.get("z") is None and "z" not in clip
    with pytest.raises(KeyError):
        clip["z"]


def test_actions_carry_the_decision_s_evidence_under_the_signature() -> None:
    from spikeguard.schemas import Evidence

    policy = RecoveryPolicy(
        PolicyConfig(non_finite_skipped_by_trainer=False), run_id="r"
    )  # recovers at once
    for step in (100, 200, 300, 400):
        policy.on_checkpoint(
            CheckpointEvent(run_id="r", step=step, checkpoint_id=f"ck-{step}", healthy=True)
        )
    evidence = Evidence(
        step=500, loss=float("nan"), grad_norm=3.5, loss_baseline=2.1, grad_norm_baseline=0.9
    )
    actions = policy.on_decision(
        Decision(
            decision_id=decision_id("r", 500),
            run_id="r",
            step=500,
            is_anomaly=True,
            type=AnomalyType.NON_FINITE,
            confidence=1.0,
            critical=True,
            evidence=evidence,
            incident_id=incident_id("r", 500),
            incident_onset_step=500,
        )
    )
    assert [a.kind for a in actions][:2] == [K.ROLLBACK, K.SKIP_BATCHES]
    assert all(a.evidence == evidence for a in actions)
    signed = sign_action(actions[0], "k")
    back = decode(encode(signed), Action)
    assert math.isnan(back.evidence.loss) and verify_action(back, "k")
    forged = signed.model_copy(update={"evidence": evidence.model_copy(update={"loss": 2.0})})
    assert not verify_action(forged, "k")  # the evidence is signed with the rest
