"""HMAC-SHA256 signatures on actions (actuators/signing.py)."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from spikeguard.schemas.signing import canonical_payload, sign_action, verify_action
from spikeguard.schemas import Action, ActionKind, decode, encode
from spikeguard.schemas.actions import RollbackParams

KEY = "test-key-0123456789"


def _action(**changes) -> Action:
    base = dict(
        action_id="a-1",
        run_id="run-1",
        kind=ActionKind.ROLLBACK,
        apply_at_step=501,
        params={"target_step": 400, "checkpoint_id": "ck-400"},
        decision_id="d-1",
        incident_id="i-1",
        reason="critical non_finite",
    )
    return Action(**{**base, **changes})


def test_round_trip() -> None:
    signed = sign_action(_action(), KEY)
    assert signed.signature and len(signed.signature) == 64
    assert verify_action(signed, KEY)
    # ... also after travelling through the codec.
    assert verify_action(decode(encode(signed), Action), KEY)


def test_deterministic_and_independent_of_key_type() -> None:
    a, b = sign_action(_action(), KEY), sign_action(_action(), KEY)
    assert a.signature == b.signature
    assert sign_action(_action(), SecretStr(KEY)).signature == a.signature
    assert sign_action(_action(), KEY.encode()).signature == a.signature
    assert sign_action(a, KEY).signature == a.signature  # re-signing ignores the old signature
    # Param order does not matter: the payload is canonical.
    reordered = _action(params={"checkpoint_id": "ck-400", "target_step": 400})
    assert sign_action(reordered, KEY).signature == a.signature


@pytest.mark.parametrize(
    "change",
    [
        {"params": RollbackParams(target_step=300, checkpoint_id="ck-400")},
        {"apply_at_step": 502},
        {"kind": ActionKind.STOP},
        {"action_id": "a-2"},
        {"run_id": "run-2"},
        {"reason": "something else"},
    ],
)
def test_tampering_is_detected(change: dict) -> None:
    signed = sign_action(_action(), KEY)
    tampered = signed.model_copy(update=change)
    assert not verify_action(tampered, KEY)


def test_wrong_key_or_missing_signature() -> None:
    signed = sign_action(_action(), KEY)
    assert not verify_action(signed, "another-key")
    assert not verify_action(_action(), KEY)
    assert not verify_action(signed.model_copy(update={"signature": "0" * 64}), KEY)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_params_sign_and_verify(value: float) -> None:
    signed = sign_action(_action(kind=ActionKind.SCALE_LR, params={"factor": value}), KEY)
    assert canonical_payload(signed) == canonical_payload(decode(encode(signed), Action))
    assert verify_action(decode(encode(signed), Action), KEY)
    finite = sign_action(_action(kind=ActionKind.SCALE_LR, params={"factor": 1.0}), KEY)
    assert finite.signature != signed.signature


# -- step events --------------------------------------------------------------
from spikeguard.schemas import StepEvent, sign_step, step_signature_problem  # noqa: E402


def _step(**changes) -> StepEvent:
    base = dict(
        run_id="run-1",
        step=7,
        epoch=1,
        time=1234.5,
        loss=float("nan"),
        grad_norm=3.25,
        lr=1e-3,
        top_grad_norms={"b": 1.0, "a": float("inf")},
    )
    return StepEvent(**{**base, **changes})


def test_a_signed_step_verifies_after_the_codec_and_only_with_its_key() -> None:
    signed = sign_step(_step(), KEY)
    assert signed.signature and len(signed.signature) == 64
    assert step_signature_problem(signed, KEY) is None
    assert step_signature_problem(decode(encode(signed), StepEvent), SecretStr(KEY)) is None
    assert "bad signature" in step_signature_problem(signed, "other-key")
    assert "unsigned" in step_signature_problem(_step(), KEY)


@pytest.mark.parametrize(
    "change",
    [
        {"loss": 1.0},
        {"step": 8},
        {"epoch": 0},
        {"run_id": "run-2"},
        {"grad_norm": None},
        {"top_grad_norms": {}},
    ],
)
def test_any_altered_field_breaks_a_step_signature(change) -> None:
    signed = sign_step(_step(), KEY)
    assert step_signature_problem(signed.model_copy(update=change), KEY) is not None


def test_a_steps_cross_rank_fields_are_signed_when_set_and_absent_from_the_payload_when_not() -> (
    None
):
    """loss_mean and loss_ranks came after steps were first signed: a one-rank step's payload is
    the one a reader that predates them computes; a several-rank step's values are signed."""
    import json

    one_rank = _step()
    body = json.loads(canonical_payload(one_rank))
    assert "loss_mean" not in body and "loss_ranks" not in body
    signed = sign_step(_step(loss_mean=0.5, loss_ranks=2), KEY)
    assert step_signature_problem(signed, KEY) is None
    for change in ({"loss_mean": 0.25}, {"loss_ranks": 4}, {"loss_mean": None}):
        assert step_signature_problem(signed.model_copy(update=change), KEY) is not None


def test_signatures_are_pinned_across_implementations_of_the_canonical_payload() -> None:
    """The signed bytes are a wire contract: a faster encoder or HMAC call must give the same
    signatures, non-finite floats, nested verdicts and free maps included (values computed
    with the reference ``hmac.new`` over ``json.dumps(..., sort_keys=True)``)."""
    import math

    from spikeguard.schemas import StepEvent, StepVerdicts, Verdict
    from spikeguard.schemas.signing import sign

    key = "pinned-key-0123456789"
    step = StepEvent(
        run_id="run-1",
        step=7,
        epoch=1,
        time=1700000000.25,
        loss=math.nan,
        grad_norm=math.inf,
        lr=3e-4,
        top_grad_norms={"b.weight": 1e-05, "a.bias": 2.5},
    )
    spike = Verdict(
        run_id="run-1",
        step=7,
        epoch=1,
        detector="statistical",
        is_anomaly=True,
        type="loss_spike",
        confidence=0.75,
        signals={"z": 12.5, "why": "loss", "n": 3, "inf": "-Infinity"},
        loss=2.0,
    )
    calm = Verdict(run_id="run-1", step=7, epoch=1, detector="rules", is_anomaly=False)
    both = StepVerdicts(run_id="run-1", step=7, epoch=1, verdicts=[spike, calm])
    assert (
        sign(step, key).signature
        == "0ffe4be876d93a5dbb5b18005babd216de836f579afadd1d395ab529890d36de"
    )
    assert (
        sign(spike, key).signature
        == "2d4c58cbd2d8f2c4b6c0ea63ab88430dfa5cfd43e3996901401ebc6ca946c8d8"
    )
    assert (
        sign(both, key).signature
        == "a252aa5aa83fa7243da7d9a5d6e8d20459765eff6444edd74498bb272f9cfe3f"
    )
    assert (
        sign_action(_action(), KEY).signature
        == "839b2a97400fb57cab701628ccc685680ace4f8a1663945ef56c1ceaed4d9ab5"
    )
