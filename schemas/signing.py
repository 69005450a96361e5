"""HMAC-SHA256 signatures on actions, so a trainer obeys only its actuator.

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

from spikeguard.schemas.events import Action


def _key_bytes(key: SecretStr | str | bytes) -> bytes:
    if isinstance(key, SecretStr):
        key = key.get_secret_value()
    return key.encode() if isinstance(key, str) else key


def canonical_payload(action: Action) -> bytes:
    body = action.model_dump(mode="json", exclude={"signature"})
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign_action(action: Action, key: SecretStr | str | bytes) -> Action:
    """A copy of ``action`` carrying its signature."""
    digest = hmac.new(_key_bytes(key), canonical_payload(action), hashlib.sha256).hexdigest()
    return action.model_copy(update={"signature": digest})


def verify_action(action: Action, key: SecretStr | str | bytes) -> bool:
    """True when the signature is present and matches; constant-time comparison."""
    if not action.signature:
        return False
    expected = hmac.new(_key_bytes(key), canonical_payload(action), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, action.signature)
