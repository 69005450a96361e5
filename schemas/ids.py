"""Deterministic ids: a record produced twice is recognisably the same record.

An id is the first 24 hex digits of the SHA-256 of its parts, ``str()``-ed and
joined by ``\\x1f``. Fusion makes one id per step, so the hot ones build that
text with an f-string (``!s`` is ``str()``) rather than a join over a
generator, which took half of the ~1.3 us an id cost.
"""

from __future__ import annotations

import secrets
import time
from hashlib import sha256


def _digest(*parts: object) -> str:
    return sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:24]


def decision_id(run_id: str, step: int, epoch: int = 0) -> str:
    """One decision per (run, epoch, step): its id depends on nothing else."""
    text = f"decision\x1f{run_id!s}\x1f{epoch!s}\x1f{step!s}"
    return "d-" + sha256(text.encode()).hexdigest()[:24]


def incident_id(run_id: str, onset_step: int, epoch: int = 0) -> str:
    text = f"incident\x1f{run_id!s}\x1f{epoch!s}\x1f{onset_step!s}"
    return "i-" + sha256(text.encode()).hexdigest()[:24]


def action_id(decision_or_incident: str, kind: str, ordinal: int = 0) -> str:
    """An action derives from what caused it, its kind, and its place among siblings."""
    return "a-" + _digest("action", decision_or_incident, kind, ordinal)


def new_session(now: float | None = None) -> str:
    """A trainer session's nonce: 12 hex digits of its start in milliseconds, then 16 random ones.

    Fixed width, so a later session compares greater as text: a stage that holds a run's
    session takes a newer one as the run starting again, and refuses an older one's records.
    """
    millis = int((time.time() if now is None else now) * 1000)
    return f"{millis:012x}{secrets.token_hex(8)}"
