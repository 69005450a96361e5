"""Deterministic ids: a record produced twice is recognisably the same record."""

from __future__ import annotations

import hashlib


def _digest(*parts: object) -> str:
    text = "\x1f".join(str(p) for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def decision_id(run_id: str, step: int, epoch: int = 0) -> str:
    """One decision per (run, epoch, step): its id depends on nothing else."""
    return "d-" + _digest("decision", run_id, epoch, step)


def incident_id(run_id: str, onset_step: int, epoch: int = 0) -> str:
    return "i-" + _digest("incident", run_id, epoch, onset_step)


def action_id(decision_or_incident: str, kind: str, ordinal: int = 0) -> str:
    """An action derives from what caused it, its kind, and its place among siblings."""
    return "a-" + _digest("action", decision_or_incident, kind, ordinal)
