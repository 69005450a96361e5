"""HMAC-SHA256 signatures on actions and step events.

Actions are signed so a trainer obeys only its actuator; step events are
signed by the trainer so that only the trainer can make the pipeline decide
(and sign actions) about its run: forged steps would otherwise buy signed
actions. Both use the run's one signing key.

The signed payload is the action's canonical JSON without the signature
field: sorted keys, no spaces (non-finite floats as Python's NaN/Infinity
tokens; the payload is hashed, never parsed). Signing twice gives the same
signature, so a replayed action keeps its id and signature, and it verifies
after an encode/decode round trip.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from pydantic import SecretStr

from pydantic import BaseModel

from spikeguard.schemas.events import Action, StepEvent


def _key_bytes(key: SecretStr | str | bytes) -> bytes:
    if isinstance(key, SecretStr):
        key = key.get_secret_value()
    return key.encode() if isinstance(key, str) else key


def canonical_payload(event: BaseModel) -> bytes:
    body = event.model_dump(mode="json", exclude={"signature"})
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _digest(event: BaseModel, key: SecretStr | str | bytes) -> str:
    return hmac.new(_key_bytes(key), canonical_payload(event), hashlib.sha256).hexdigest()


def sign_action(action: Action, key: SecretStr | str | bytes) -> Action:
    """A copy of ``action`` carrying its signature."""
    return action.model_copy(update={"signature": _digest(action, key)})


def verify_action(action: Action, key: SecretStr | str | bytes) -> bool:
    """True when the signature is present and matches; constant-time comparison."""
    if not action.signature:
        return False
    return hmac.compare_digest(_digest(action, key), action.signature)


def sign_step(event: StepEvent, key: SecretStr | str | bytes) -> StepEvent:
    """A copy of the trainer's step event carrying its signature."""
    return event.model_copy(update={"signature": _digest(event, key)})


def step_signature_problem(event: StepEvent, key: SecretStr | str | bytes) -> str | None:
    """Why ``event`` is not authentic under ``key`` (None when it is); constant-time comparison."""
    if not event.signature:
        return "unsigned step event (the run signs its steps; forged or from a trainer without the key)"
    if not hmac.compare_digest(_digest(event, key), event.signature):
        return "bad step signature (forged, altered, or signed with another key)"
    return None
