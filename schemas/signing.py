"""HMAC-SHA256 signatures on every record that can lead to an action.

Whoever produces a record signs it, and whoever acts on it checks it first
(:data:`SIGNERS`): the trainer signs its step events, run events (a run's
start and end: its settings, and an end drops its state), checkpoint events
(they choose the rollback target) and acks (they say whether a rollback
counted); detector workers sign verdicts, fusion signs decisions, the
actuator signs actions. A record anyone else wrote, without the key, is
refused by its consumer: forged steps would buy signed actions, a forged
decision far ahead would make every real one look late, a forged checkpoint
would choose the rollback target. :mod:`spikeguard.trust` says which key each
role holds.

One shared key signs everything by default. A :class:`Keyring` gives each role
its own (:class:`Role`): a record is signed with, and checked against, the key
of the role entitled to produce its type (:data:`ROLE_OF`), so a process that
holds only the detectors' key cannot sign a decision or an action. Wherever a
key is taken, a keyring may be given instead.

The signed payload is the action's canonical JSON without the signature
field: sorted keys, no spaces (non-finite floats as Python's NaN/Infinity
tokens; the payload is hashed, never parsed). Signing twice gives the same
signature, so a replayed action keeps its id and signature, and it verifies
after an encode/decode round trip.

In one process a signed record is verified once, however many stages read it:
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
from collections import OrderedDict
from enum import Enum
from functools import lru_cache
from typing import Mapping, Union

from pydantic import BaseModel, SecretStr

from spikeguard.errors import RecordNotAuthenticated, RunEventNotAuthenticated, StepNotAuthenticated
from spikeguard.schemas.events import (
    Ack,
    Action,
    CheckpointEvent,
    Decision,
    RunEvent,
    StepEvent,
    StepVerdicts,
    Verdict,
)


class Role(str, Enum):
    """Who produces signed records, each with its own key in a :class:`Keyring`."""

    TRAINER = "trainer"
    DETECTORS = "detectors"
    FUSION = "fusion"
    ACTUATOR = "actuator"


#: The one role entitled to produce each signed record type.
ROLE_OF: dict[type[BaseModel], Role] = {
    StepEvent: Role.TRAINER,
    RunEvent: Role.TRAINER,
    CheckpointEvent: Role.TRAINER,
    Ack: Role.TRAINER,
    Verdict: Role.DETECTORS,
    StepVerdicts: Role.DETECTORS,
    Decision: Role.FUSION,
    Action: Role.ACTUATOR,
}


class Keyring:
    """The keys a process holds, one per role; a role it holds no key for is None.

    Its records of a type are signed with that type's role's key, and a record
    is checked against its type's role's key only: a verdict key never makes a
    decision authentic. Never shows a key (``repr`` names the roles held).
    """

    __slots__ = ("_keys",)

    def __init__(self, keys: Mapping[Role, SecretStr | str | bytes | None]) -> None:
        self._keys = {Role(role): key for role, key in keys.items() if key is not None}

    def key_of(self, role: Role) -> SecretStr | str | bytes | None:
        return self._keys.get(role)

    def key_for(self, record_type: type) -> SecretStr | str | bytes | None:
        role = role_of(record_type)
        return None if role is None else self._keys.get(role)

    @property
    def roles(self) -> frozenset[Role]:
        return frozenset(self._keys)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Keyring) and {
            r: key_fingerprint(k) for r, k in self._keys.items()
        } == {r: key_fingerprint(k) for r, k in other._keys.items()}

    def __hash__(self) -> int:
        return hash(frozenset((r, key_fingerprint(k)) for r, k in self._keys.items()))

    def __repr__(self) -> str:
        return f"Keyring(holds={sorted(r.value for r in self._keys)})"


SigningKey = Union[SecretStr, str, bytes, Keyring]


def role_of(record_type: type) -> Role | None:
    """The role entitled to produce records of ``record_type`` (None: not a signed type)."""
    role = ROLE_OF.get(record_type)
    if role is None:
        role = next((r for t, r in ROLE_OF.items() if issubclass(record_type, t)), None)
    return role


class NoKeyForRole(ValueError):
    """This process holds no key for the role that signs a record type."""


def key_for(record: BaseModel | type, key: SigningKey) -> SecretStr | str | bytes:
    """The key that signs ``record`` (an instance or a type): ``key`` itself, or its keyring's one
    for the record's role; :class:`NoKeyForRole` when the keyring holds none for it."""
    if not isinstance(key, Keyring):
        return key
    record_type = record if isinstance(record, type) else type(record)
    found = key.key_for(record_type)
    if found is None:
        role = role_of(record_type)
        raise NoKeyForRole(
            f"this process holds no {role.value if role else '?'} key (it signs "
            f"{record_type.__name__} records); set SPIKEGUARD_"
            f"{(role.value if role else '?').upper()}_KEY or the shared SPIKEGUARD_SIGNING_KEY"
        )
    return found


def _key_bytes(key: SecretStr | str | bytes) -> bytes:
    if isinstance(key, SecretStr):
        key = key.get_secret_value()
    return key.encode() if isinstance(key, str) else key


#: The canonical JSON encoder, made once: ``json.dumps`` with these options builds a new
#: encoder at every call, a few microseconds each, several digests per step.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_NOT_SIGNED = {"signature"}


def canonical_payload(event: BaseModel) -> bytes:
    body = event.model_dump(mode="json", exclude=_NOT_SIGNED)
    # Optional fields added after a record type was first signed are signed only when set,
    # so a record without them has the digest a reader that predates them computes.
    for name in getattr(type(event), "signed_when_set", ()):
        if body.get(name) is None:
            body.pop(name, None)
    if type(event) is StepVerdicts:  # the verdicts inside, likewise
        for verdict in body["verdicts"]:
            for name in Verdict.signed_when_set:
                if verdict.get(name) is None:
                    verdict.pop(name, None)
    return _CANONICAL_JSON.encode(body).encode()


def _digest(event: BaseModel, key: SecretStr | str | bytes) -> str:
    # hmac.digest: one call into OpenSSL, the same HMAC-SHA256 as hmac.new(...).hexdigest().
    return hmac.digest(_key_bytes(key), canonical_payload(event), "sha256").hex()


def sign_action(action: Action, key: SigningKey) -> Action:
    """A copy of ``action`` carrying its signature."""
    return action.model_copy(update={"signature": _digest(action, key_for(action, key))})


def verify_action(action: Action, key: SigningKey) -> bool:
    """True when the signature is present and matches; constant-time comparison."""
    if not action.signature:
        return False
    try:
        key = key_for(action, key)
    except NoKeyForRole:
        return False
    return hmac.compare_digest(_digest(action, key), action.signature)


class VerifiedRecords:
    """Signed record objects already known authentic in this process, per key.

    Keyed by object identity and holding a strong reference (so an id is never
    reused while marked); records are frozen, so a marked object cannot change
    after its check. Bounded: the oldest marks go first, and a record whose mark
    went is simply checked again.
    """

    def __init__(self, capacity: int = 16384) -> None:
        self.capacity = capacity
        # An OrderedDict: evicting the oldest is O(1) (a dict's front, after many deletions, is not).
        self._marks: OrderedDict[int, tuple[BaseModel, bytes]] = OrderedDict()
        self._lock = threading.Lock()  # several worker threads mark and evict at once

    def mark(self, event: BaseModel, key: SecretStr | str | bytes) -> None:
        if type(event) not in SIGNED_TYPES:  # a subclass could be made mutable: check it every time
            return
        fingerprint = key_fingerprint(key)
        with self._lock:
            marks = self._marks
            marks[id(event)] = (event, fingerprint)
            while len(marks) > self.capacity:
                marks.popitem(last=False)

    def holds(self, event: BaseModel, key: SecretStr | str | bytes) -> bool:
        found = self._marks.get(id(event))
        return found is not None and found[0] is event and found[1] == key_fingerprint(key)

    def clear(self) -> None:
        with self._lock:
            self._marks.clear()

    def __len__(self) -> int:
        return len(self._marks)


VerifiedSteps = VerifiedRecords  # the name the step-only version had


def key_fingerprint(key: SecretStr | str | bytes) -> bytes:
    """What a mark remembers of the key: its hash, never the key itself."""
    return _fingerprint(_key_bytes(key))


@lru_cache(maxsize=16)  # a process holds a key or two: hashed once each, not once per record
def _fingerprint(key: bytes) -> bytes:
    return hashlib.sha256(b"spikeguard-step-key\0" + key).digest()


#: The process's marks: set by :func:`sign` (this process made the signature
#: itself) and by a successful :func:`signature_problem`.
VERIFIED = VERIFIED_STEPS = VerifiedRecords()

#: Every record type that carries a signature, and who signs it.
SIGNERS: dict[type[BaseModel], str] = {
    StepEvent: "the run's trainer",
    RunEvent: "the run's trainer",
    CheckpointEvent: "the run's trainer",
    Ack: "the run's trainer",
    Verdict: "a detector worker",
    StepVerdicts: "a detector worker",
    Decision: "fusion",
    Action: "the actuator",
}
SIGNED_TYPES = frozenset(SIGNERS)
_WHAT = {
    StepEvent: "step event",
    RunEvent: "run event",
    CheckpointEvent: "checkpoint event",
    Ack: "ack",
    Verdict: "verdict",
    StepVerdicts: "step's verdicts",
    Decision: "decision",
    Action: "action",
}


def sign(record: BaseModel, key: SigningKey) -> BaseModel:
    """A copy of ``record`` (any of :data:`SIGNED_TYPES`) carrying its signature, marked verified here."""
    key = key_for(record, key)
    signed = record.model_copy(update={"signature": _digest(record, key)})
    VERIFIED.mark(signed, key)
    return signed


def describe_type(record_type: type) -> str:
    """What a record of ``record_type`` is called in a refusal: "step event", "verdict", ..."""
    found = _WHAT.get(record_type)  # type: ignore[call-overload]
    return found or next(
        (w for t, w in _WHAT.items() if issubclass(record_type, t)), record_type.__name__
    )


def signature_problem(record: BaseModel, key: SigningKey) -> str | None:
    """Why ``record`` is not authentic under ``key`` (None when it is); constant-time comparison.

    The very object already found authentic under ``key`` in this process is not
    hashed again (:data:`VERIFIED`); anything else is.
    """
    what = describe_type(type(record))
    signature = getattr(record, "signature", None)
    if not signature:
        signer = next((s for t, s in SIGNERS.items() if isinstance(record, t)), "its producer")
        return f"no signature (an unsigned {what}; {signer} signs it: forged, or from a process without the key)"
    whose = ""
    if isinstance(key, Keyring):
        role = role_of(type(record))
        whose = f": only the {role.value if role else '?'} key signs {what}s"
        try:
            key = key_for(record, key)
        except NoKeyForRole as exc:
            return f"cannot check its signature ({exc})"
    if VERIFIED.holds(record, key):
        return None
    if not hmac.compare_digest(_digest(record, key), signature):
        return f"bad signature (the {what} was forged, altered, or signed with another key{whose})"
    VERIFIED.mark(record, key)
    return None


class Signer:
    """The one key a process signs and checks with (a shared key or a :class:`Keyring`), or none.

    Made once where the key is read (settings, a Guard's config) and handed to
    everything that signs or checks, so that no part looks for a key of its own.
    Without a key it signs nothing and accepts everything: the caller decides
    whether that is allowed (:mod:`spikeguard.trust`).
    """

    __slots__ = ("key",)

    def __init__(self, key: SigningKey | None = None) -> None:
        self.key = key

    @property
    def enabled(self) -> bool:
        """A key is held: records are signed, and the unsigned refused."""
        return self.key is not None

    def sign(self, record: BaseModel) -> BaseModel:
        """``record`` signed (any of :data:`SIGNED_TYPES`), or as it is without a key or with a
        signature already."""
        if (
            self.key is None
            or type(record) not in SIGNED_TYPES
            or getattr(record, "signature", None) is not None
        ):
            return record
        return sign(record, self.key)

    def problem(self, record: BaseModel) -> str | None:
        """Why ``record`` is not authentic (None: it is, or no key is held)."""
        return None if self.key is None else signature_problem(record, self.key)

    def verifies(self, action: Action) -> bool:
        """``action`` carries a signature that matches, or no key is held (nothing to check with)."""
        return self.key is None or verify_action(action, self.key)

    def __repr__(self) -> str:
        return f"Signer({'no key' if self.key is None else 'a key'})"


def sign_step(event: StepEvent, key: SigningKey) -> StepEvent:
    """A copy of the trainer's step event carrying its signature (marked verified here)."""
    return sign(event, key)  # type: ignore[return-value]


def step_signature_problem(event: StepEvent, key: SigningKey) -> str | None:
    """Why ``event`` is not authentic under ``key`` (None when it is)."""
    return signature_problem(event, key)


def sign_run_event(event: RunEvent, key: SigningKey) -> RunEvent:
    """A copy of the trainer's run start or end carrying its signature."""
    return sign(event, key)  # type: ignore[return-value]


def run_event_signature_problem(event: RunEvent, key: SigningKey) -> str | None:
    """Why ``event`` is not authentic under ``key`` (None when it is)."""
    return signature_problem(event, key)


def describe(record: BaseModel) -> str:
    """How a refusal names ``record``: "run start at step 0", "step 12", "decision for step 12 of epoch 1", ..."""
    if isinstance(record, RunEvent):
        return f"run {record.kind} at step {record.step}"
    what = _WHAT.get(type(record)) or next(
        (w for t, w in _WHAT.items() if isinstance(record, t)), "record"
    )
    if isinstance(record, StepEvent):
        return f"step {record.step}" + (f" of epoch {record.epoch}" if record.epoch else "")
    step, epoch = getattr(record, "step", None), getattr(record, "epoch", 0)
    if isinstance(record, Verdict):
        what = f"{record.detector} verdict"
    if step is None:
        return what
    return f"{what} for step {step}" + (f" of epoch {epoch}" if epoch else "")


def authenticate(record: BaseModel, key: SigningKey | None) -> None:
    """Raise a RecordNotAuthenticated subclass naming the run, the record and why, unless
    ``record`` is signed with ``key``.

    No key (``--insecure``, backtests, replays): nothing to check. Every stage's
    ``admit`` calls this first, so a refused record changes nothing.
    """
    if key is None:
        return
    problem = signature_problem(record, key)
    if problem is None:
        return
    run_id = getattr(record, "run_id", "?")
    if isinstance(record, RunEvent):
        raise RunEventNotAuthenticated(
            f"run {run_id} {record.kind}: {problem}; refused, the run's "
            "settings and state are unchanged"
        )
    if isinstance(record, StepEvent):
        raise StepNotAuthenticated(f"run {run_id} step {record.step}: {problem}")
    raise RecordNotAuthenticated(
        f"run {run_id} {describe(record)}: {problem}; refused, nothing acts on it"
    )
