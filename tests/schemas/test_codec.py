"""Events round-trip through JSON, non-finite floats included; bad input names its problem."""

import json
import math

import pytest

from spikeguard.errors import MalformedMessage, MessageTooLarge, SchemaError, UnknownSchemaVersion
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    CheckpointEvent,
    DeadLetter,
    Decision,
    StepEvent,
    Verdict,
    action_id,
    decision_id,
    decode,
    decode_any,
    encode,
    json_schemas,
)

STEP = StepEvent(run_id="r1", step=7, loss=2.5, grad_norm=1.25, lr=3e-4)


@pytest.mark.parametrize(
    "value, text",
    [(math.nan, '"NaN"'), (math.inf, '"Infinity"'), (-math.inf, '"-Infinity"')],
)
def test_non_finite_floats_travel_as_strings_and_come_back(value, text):
    event = StepEvent(run_id="r1", step=1, loss=value, grad_norm=value)
    data = encode(event)
    assert f'"loss":{text}' in data.decode()
    json.loads(data)  # strict JSON: no bare NaN tokens
    back = decode(data, StepEvent)
    assert (math.isnan(back.loss) and math.isnan(value)) or back.loss == value
    assert not back.finite


@pytest.mark.parametrize(
    "event",
    [
        STEP,
        Verdict(
            run_id="r1",
            step=7,
            detector="rules",
            is_anomaly=True,
            confidence=1.0,
            critical=True,
            rules=["non_finite_loss"],
            signals={"z": math.inf},
        ),
        Decision(decision_id=decision_id("r1", 7), run_id="r1", step=7, is_anomaly=True),
        Action(
            action_id=action_id("d", "rollback"),
            run_id="r1",
            kind=ActionKind.ROLLBACK,
            apply_at_step=9,
            params={"target_step": 5, "checkpoint_id": "c5"},
        ),
        Ack(run_id="r1", action_id="a", kind=ActionKind.CLIP, status=AckStatus.APPLIED, step=9),
        CheckpointEvent(run_id="r1", step=5, checkpoint_id="c5", healthy=True),
        DeadLetter(source_topic="t", value="x", error="E", reason="why"),
    ],
)
def test_every_event_round_trips_and_is_recognised_without_a_type(event):
    data = encode(event)
    assert decode(data, type(event)) == event
    assert type(decode_any(data)) is type(event)
    assert json.loads(data)["schema_version"] == 1


def test_decode_reads_every_buffer_type_it_declares():
    event = StepEvent(run_id="r1", step=3, loss=1.5, grad_norm=2.0)
    data = encode(event)
    for buffer in (data, bytearray(data), memoryview(data), data.decode()):
        assert decode(buffer, StepEvent) == event


@pytest.mark.parametrize(
    "data, error, words",
    [
        (b"{not json", MalformedMessage, "not JSON"),
        (b"[1, 2]", MalformedMessage, "expected a JSON object"),
        (b'{"run_id": "", "step": 1, "loss": 1}', MalformedMessage, "run_id"),
        (b'{"run_id": "a", "step": -1, "loss": 1}', MalformedMessage, "step"),
        (b'{"run_id": "a", "step": 1, "loss": "high"}', MalformedMessage, "loss"),
        (b'{"run_id": "a", "step": 1}', MalformedMessage, "loss: Field required"),
        (b'{"schema_version": 9, "run_id": "a", "step": 1, "loss": 1}', UnknownSchemaVersion, "9"),
        (b"", MalformedMessage, "empty"),
        (b"\xff\xfe", MalformedMessage, "StepEvent"),
        (b" " * 1_000_001, MessageTooLarge, "1000001 bytes"),
    ],
)
def test_bad_input_raises_a_schema_error_that_says_what_is_wrong(data, error, words):
    with pytest.raises(error) as caught:
        decode(data, StepEvent)
    assert isinstance(caught.value, SchemaError)
    assert words in str(caught.value)


def test_run_id_with_whitespace_is_refused():
    with pytest.raises(MalformedMessage, match="run_id"):
        decode(b'{"run_id": "a b", "step": 1, "loss": 1}', StepEvent)


def test_unknown_fields_from_a_newer_writer_are_ignored():
    event = decode(b'{"run_id": "a", "step": 1, "loss": 1, "future_field": 3}', StepEvent)
    assert event.loss == 1


def test_derived_ids_are_deterministic_and_distinct():
    assert decision_id("r", 5) == decision_id("r", 5)
    assert decision_id("r", 5) != decision_id("r", 6) != decision_id("r2", 5)
    assert decision_id("r", 5, epoch=1) != decision_id("r", 5, epoch=0)
    assert action_id("d1", "rollback", 0) != action_id("d1", "rollback", 1)


def test_decode_any_refuses_an_object_of_no_known_type():
    with pytest.raises(MalformedMessage, match="no event type"):
        decode_any(b'{"hello": 1}')


def test_json_schemas_cover_every_event():
    schemas = json_schemas()
    assert set(schemas) == {
        "StepEvent",
        "Verdict",
        "StepVerdicts",
        "Decision",
        "Action",
        "Ack",
        "CheckpointEvent",
        "DeadLetter",
        "RunEvent",
    }
    assert "loss" in schemas["StepEvent"]["properties"]
