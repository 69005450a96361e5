"""HMAC-SHA256 signatures on actions, step events and run events.

Actions are signed so a trainer obeys only its actuator; step events are
signed by the trainer so that only the trainer can make the pipeline decide
(and sign actions) about its run: forged steps would otherwise buy signed
actions. Run events (a run's start and end on the compacted runs topic) are
signed by the trainer too: they carry the settings fusion and the actuator
apply to the run, and an end drops the run's detector state, so a forged one
could disarm a run its writer does not own. All use the run's one signing key.

The signed payload is the action's canonical JSON without the signature
field: sorted keys, no spaces (non-finite floats as Python's NaN/Infinity
tokens; the payload is hashed, never parsed). Signing twice gives the same
signature, so a replayed action keeps its id and signature, and it verifies
after an encode/decode round trip.

In one process a step event is verified once, however many stages read it:
the embedded bus hands every consumer the same (frozen) event object, so a
verdict on that object holds for all of them. The mark is the object itself
held in this process's memory, next to a fingerprint of the key, never a field
of the event: a publisher cannot set it, and any other object (a copy with a
copied signature, a decoded twin, an altered ``model_copy``) is checked in full.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading

from pydantic import SecretStr

from pydantic import BaseModel

from spikeguard.schemas.events import Action, RunEvent, StepEvent


def _key_bytes(key: SecretStr | str | bytes) -> bytes:
    if isinstance(key, SecretStr):
        key = key.get_secret_value()
    return key.encode() if isinstance(key, str) else key


def canonical_payload(event: BaseModel) -> bytes:
    body = event.model_dump(mode="json", exclude={"signature"})
    # Optional fields added after a record type was first signed are signed only when set,
    # so a record without them has the digest a reader that predates them computes.
    for name in getattr(type(event), "signed_when_set", ()):
        if body.get(name) is None:
            body.pop(name, None)
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


class VerifiedSteps:
    """Step event objects already known authentic in this process, per key.

    Keyed by object identity and holding a strong reference (so an id is never
    reused while marked); events are frozen, so a marked object cannot change
    after its check. Bounded: the oldest marks go first, and an event whose mark
    went is simply checked again.
    """

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._marks: dict[int, tuple[StepEvent, bytes]] = {}
        self._lock = threading.Lock()  # several worker threads mark and evict at once

    def mark(self, event: StepEvent, key: SecretStr | str | bytes) -> None:
        if type(event) is not StepEvent:  # a subclass could be made mutable: check it every time
            return
        fingerprint = key_fingerprint(key)
        with self._lock:
            marks = self._marks
            marks[id(event)] = (event, fingerprint)
            while len(marks) > self.capacity:
                del marks[next(iter(marks))]

    def holds(self, event: StepEvent, key: SecretStr | str | bytes) -> bool:
        found = self._marks.get(id(event))
        return found is not None and found[0] is event and found[1] == key_fingerprint(key)

    def clear(self) -> None:
        with self._lock:
            self._marks.clear()

    def __len__(self) -> int:
        return len(self._marks)


def key_fingerprint(key: SecretStr | str | bytes) -> bytes:
    """What a mark remembers of the key: its hash, never the key itself."""
    return hashlib.sha256(b"spikeguard-step-key\0" + _key_bytes(key)).digest()


#: The process's marks: set by :func:`sign_step` (the trainer made the signature
#: itself) and by a successful :func:`step_signature_problem`.
VERIFIED_STEPS = VerifiedSteps()


def sign_step(event: StepEvent, key: SecretStr | str | bytes) -> StepEvent:
    """A copy of the trainer's step event carrying its signature (marked verified here)."""
    signed = event.model_copy(update={"signature": _digest(event, key)})
    VERIFIED_STEPS.mark(signed, key)
    return signed


def step_signature_problem(event: StepEvent, key: SecretStr | str | bytes) -> str | None:
    """Why ``event`` is not authentic under ``key`` (None when it is); constant-time comparison.

    The very object already found authentic under ``key`` in this process is not
    hashed again (:data:`VERIFIED_STEPS`); anything else is.
    """
    if not event.signature:
        return "unsigned step event (the run signs its steps; forged or from a trainer without the key)"
    if VERIFIED_STEPS.holds(event, key):
        return None
    if not hmac.compare_digest(_digest(event, key), event.signature):
        return "bad step signature (forged, altered, or signed with another key)"
    VERIFIED_STEPS.mark(event, key)
    return None


def sign_run_event(event: RunEvent, key: SecretStr | str | bytes) -> RunEvent:
    """A copy of the trainer's run start or end carrying its signature."""
    return event.model_copy(update={"signature": _digest(event, key)})


def run_event_signature_problem(event: RunEvent, key: SecretStr | str | bytes) -> str | None:
    """Why ``event`` is not authentic under ``key`` (None when it is); constant-time comparison.

    Not cached like steps: a run has two run events (a start and an end), so
    hashing each once per stage costs nothing worth remembering.
    """
    if not event.signature:
        return "no signature (the run's Guard signs its run events: forged, or from a trainer without the key)"
    if not hmac.compare_digest(_digest(event, key), event.signature):
        return "bad signature (forged, altered, or signed with another key)"
    return None
