"""Every decoder, fed anything, returns an event or raises one of the package's SchemaErrors."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spikeguard.errors import SchemaError
from spikeguard.schemas import decode, decode_any, encode
from spikeguard.schemas.events import EVENT_TYPES

from .strategies import hostile, json_values, dumps

FAST = settings(
    max_examples=100, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def _decodes_or_refuses(data: bytes, model: type) -> None:
    try:
        event = decode(data, model)
    except SchemaError as exc:
        assert str(exc)  # the DLQ's reason
        return
    assert isinstance(event, model)
    # What decodes re-encodes and decodes to the same event: nothing half-parsed
    # (compared as bytes: a NaN field is not equal to itself).
    assert encode(decode(encode(event), model)) == encode(event)


@pytest.mark.parametrize("model", EVENT_TYPES, ids=lambda m: m.__name__)
@FAST
@given(data=st.data())
@pytest.mark.heavy
def test_decode_of_anything_returns_the_model_or_raises_a_schema_error(model, data):
    _decodes_or_refuses(data.draw(hostile(model)), model)


@pytest.mark.parametrize("model", EVENT_TYPES, ids=lambda m: m.__name__)
@FAST
@given(text=st.text(max_size=200))
def test_decode_of_any_text_returns_the_model_or_raises_a_schema_error(model, text):
    _decodes_or_refuses(text, model)


@FAST
@given(
    data=st.one_of(
        st.binary(max_size=300), json_values.map(dumps), *[hostile(m) for m in EVENT_TYPES]
    )
)
def test_decode_any_returns_an_event_or_raises_a_schema_error(data):
    try:
        event = decode_any(data)
    except SchemaError as exc:
        assert str(exc)
        return
    assert type(event) in EVENT_TYPES
