"""Building the DLQ record for a record that could not be processed, and why."""

from __future__ import annotations

from spikeguard.bus.base import Record
from spikeguard.schemas import DeadLetter


def dead_letter(record: Record, exc: BaseException, consumer: str) -> DeadLetter:
    value = record.value or b""
    return DeadLetter(
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key_text,
        value=value.decode("utf-8", "backslashreplace"),
        value_bytes=len(value),
        error=type(exc).__name__,
        reason=str(exc) or repr(exc),
        consumer=consumer,
    )
