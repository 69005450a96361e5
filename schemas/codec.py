"""JSON encoding of events: bytes on the wire, models in the code.

``decode`` never lets a pydantic or JSON error escape: every failure is a
:class:`~spikeguard.errors.SchemaError` subclass whose message says what is
wrong, so a worker can send the record to the DLQ with that reason.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from spikeguard.errors import MalformedMessage, MessageTooLarge, UnknownSchemaVersion
from spikeguard.schemas.events import (
    EVENT_TYPES,
    SCHEMA_VERSION,
    Ack,
    Action,
    CheckpointEvent,
    DeadLetter,
    Decision,
    RunEvent,
    StepEvent,
    StepVerdicts,
    Verdict,
)

# Kafka's default max.message.bytes is ~1 MB; an event is a few hundred bytes.
MAX_MESSAGE_BYTES = 1_000_000

M = TypeVar("M", bound=BaseModel)

_MARKERS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("source_topic", DeadLetter),
    ("apply_at_step", Action),
    ("action_id", Ack),
    ("decision_id", Decision),
    ("checkpoint_id", CheckpointEvent),
    ("detector", Verdict),
    ("verdicts", StepVerdicts),
    ("loss", StepEvent),
    ("checkpoint_every", RunEvent),
)


def encode(event: BaseModel) -> bytes:
    """The event as compact UTF-8 JSON; NaN/Infinity as strings."""
    return event.model_dump_json().encode()


def decode(
    data: bytes | bytearray | memoryview | str, model: type[M], max_bytes: int = MAX_MESSAGE_BYTES
) -> M:
    """Parse ``data`` into ``model`` or raise a SchemaError that says why.

    ``max_bytes``: a bigger message is refused before parsing (a worker sets its own, lower).
    """
    if data is None:
        raise MalformedMessage(f"{model.__name__}: empty record (null value)")
    size = len(data)
    if size > max_bytes:
        raise MessageTooLarge(
            f"{model.__name__}: message of {size} bytes exceeds the {max_bytes}-byte limit"
        )
    if size == 0:
        raise MalformedMessage(f"{model.__name__}: empty record")
    if isinstance(data, memoryview):  # pydantic reads str, bytes and bytearray only
        data = data.tobytes()
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise _explain(exc, model) from None
    except (UnicodeDecodeError, ValueError) as exc:  # pragma: no cover - defensive
        raise MalformedMessage(f"{model.__name__}: {exc}") from None


def decode_any(data: bytes | str) -> BaseModel:
    """Decode a record whose type is not known in advance (replay, audit)."""
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedMessage(f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise MalformedMessage(f"expected a JSON object, got {type(raw).__name__}")
    keys = set(raw)
    # Each record type has a field no other type has.
    for marker, model in _MARKERS:
        if marker in keys:
            return decode(data, model)
    raise MalformedMessage(f"no event type has the fields {sorted(keys)}")


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schema of every event, by model name (for other languages' tools)."""
    return {model.__name__: model.model_json_schema() for model in EVENT_TYPES}


def _explain(exc: ValidationError, model: type[BaseModel]) -> Exception:
    errors = exc.errors(include_url=False)
    for error in errors:
        if error["loc"][:1] == ("schema_version",) and error["type"] != "missing":
            return UnknownSchemaVersion(
                f"{model.__name__}: schema_version {error.get('input')!r} is not one this "
                f"reader knows (it reads {SCHEMA_VERSION})"
            )
    if errors and errors[0]["type"] == "json_invalid":
        return MalformedMessage(f"{model.__name__}: not JSON ({errors[0]['msg']})")
    if errors and errors[0]["type"] == "model_type":
        return MalformedMessage(f"{model.__name__}: expected a JSON object")
    parts = []
    for error in errors[:5]:
        where = ".".join(str(p) for p in error["loc"]) or "<record>"
        parts.append(f"{where}: {error['msg']} (got {error.get('input')!r:.60})")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return MalformedMessage(f"{model.__name__}: " + "; ".join(parts) + more)
