"""Hypothesis strategies for hostile records: arbitrary bytes, arbitrary JSON, near-valid events."""

from __future__ import annotations

import json
import math

from hypothesis import strategies as st

from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    CheckpointEvent,
    DeadLetter,
    Decision,
    RunEvent,
    StepEvent,
    StepVerdicts,
    Verdict,
)

# Scalars a forger would try: huge and negative integers, non-finite floats in both
# spellings, long and control-character strings.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=2**53 - 2, max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["NaN", "Infinity", "-Infinity", "nan", "", "\x00", "1e999"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

VALID = {
    StepEvent: dict(run_id="r", step=3, epoch=0, time=1.0, loss=2.0, grad_norm=1.0, lr=1e-3),
    Verdict: dict(
        run_id="r",
        step=3,
        detector="rules",
        is_anomaly=True,
        type="non_finite",
        confidence=1.0,
        critical=True,
        loss="NaN",
    ),
    StepVerdicts: dict(
        run_id="r",
        step=3,
        verdicts=[
            dict(
                run_id="r",
                step=3,
                detector="rules",
                is_anomaly=True,
                type="non_finite",
                confidence=1.0,
                critical=True,
                loss="NaN",
            ),
            dict(run_id="r", step=3, detector="statistical", is_anomaly=False, confidence=0.0),
        ],
    ),
    Decision: dict(
        decision_id="d",
        run_id="r",
        step=3,
        is_anomaly=True,
        type="non_finite",
        confidence=1.0,
        critical=True,
        urgency="critical",
        evidence={"step": 3, "loss": "NaN"},
    ),
    Action: dict(
        action_id="a",
        run_id="r",
        kind=ActionKind.SCALE_LR.value,
        apply_at_step=4,
        params={"factor": 0.5},
    ),
    Ack: dict(
        run_id="r",
        action_id="a",
        kind=ActionKind.SCALE_LR.value,
        status=AckStatus.APPLIED.value,
        step=4,
    ),
    CheckpointEvent: dict(run_id="r", step=3, checkpoint_id="c", healthy=True),
    DeadLetter: dict(source_topic="t", value="x", error="E", reason="why"),
    RunEvent: dict(
        run_id="r",
        kind="start",
        preset="large",
        policy={"spike_patience_steps": 4},
        checkpoint_every=50,
        keep_checkpoints=4,
        detection_delay_steps=25,
    ),
}


def dumps(value: object) -> bytes:
    # allow_nan: Python's NaN/Infinity tokens are not JSON, and a forger may send them.
    return json.dumps(value, allow_nan=True).encode()


def near_valid(model: type) -> st.SearchStrategy[bytes]:
    """A valid record of ``model`` with fields replaced, removed or added at random."""
    base = {**VALID[model], "schema_version": 1}
    fields = sorted(set(model.model_fields) | set(base))

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        record = dict(base)
        for name in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):
            if draw(st.booleans()):
                record[name] = draw(json_values)
            else:
                record.pop(name, None)
        return dumps(record)

    return build()


def hostile(model: type) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=300),
        json_values.map(dumps),
        near_valid(model),
        st.builds(
            lambda n: b'{"run_id": "r", "loss": 1, "pad": "' + b"x" * n + b'"}',
            st.sampled_from([10, 1_000_001]),
        ),
    )


def finite_or_none(value: float | None) -> bool:
    return value is None or math.isfinite(value)
