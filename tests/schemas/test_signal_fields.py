"""The step event's mechanism-signal fields: optional, signed when set, invisible when not."""

from __future__ import annotations

import json
import math

from spikeguard.schemas import StepEvent, decode, encode
from spikeguard.schemas.signing import canonical_payload, sign_step, step_signature_problem

KEY = "k" * 32


def test_a_step_without_signals_signs_as_it_did_before_they_existed():
    plain = StepEvent(run_id="r", step=3, loss=2.0, grad_norm=1.0, time=0.0)
    payload = json.loads(canonical_payload(plain))
    assert "attention_logit_max" not in payload and "update_ratio" not in payload
    # A record written before the fields existed parses, and its signature still verifies.
    old = json.loads(encode(sign_step(plain, KEY)))
    old.pop("attention_logit_max", None), old.pop("update_ratio", None)
    assert step_signature_problem(decode(json.dumps(old), StepEvent), KEY) is None


def test_the_signature_covers_the_signals_and_they_round_trip_non_finite():
    event = sign_step(
        StepEvent(
            run_id="r",
            step=3,
            loss=2.0,
            time=0.0,
            attention_logit_max=math.inf,
            update_ratio=0.031,
        ),
        KEY,
    )
    back = decode(encode(event), StepEvent)
    assert back.attention_logit_max == math.inf and back.update_ratio == 0.031
    assert step_signature_problem(back, KEY) is None
    forged = back.model_copy(update={"attention_logit_max": 12.0})
    assert step_signature_problem(forged, KEY) is not None
