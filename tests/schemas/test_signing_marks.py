"""A step is verified once per process, and the mark cannot be forged (the embedded pipeline's cost).

The stages of the embedded pipeline receive the very event object the trainer
published; hashing it once for all of them is safe only if nothing but that
object, checked under that key, is ever let through unhashed.
"""

from __future__ import annotations

import math

import pytest

from spikeguard.bus import EmbeddedBus
from spikeguard.components import build_stage
from spikeguard.schemas import DeadLetter, StepEvent, Topics, decode, encode, sign_step
from spikeguard.schemas import signing
from spikeguard.schemas.signing import VERIFIED_STEPS, VerifiedSteps, step_signature_problem
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

KEY = "run-key-0123456789abcdef"
TOPICS = Topics("marks-test.")
DETECTORS = ("statistical", "rules", "ml", "predictor")


def step(s: int, loss: float = 1.0) -> StepEvent:
    return StepEvent(run_id="r", step=s, time=1000.0 + s, loss=loss, grad_norm=1.0, lr=1e-3)


@pytest.fixture(autouse=True)
def fresh_marks():
    VERIFIED_STEPS.clear()
    yield
    VERIFIED_STEPS.clear()


@pytest.fixture
def digests(monkeypatch):
    """How many HMACs signing computes."""
    count = [0]
    real = signing._digest

    def counting(event, key):
        count[0] += 1
        return real(event, key)

    monkeypatch.setattr(signing, "_digest", counting)
    return count


def test_an_object_verified_once_is_not_hashed_again_under_the_same_key(digests):
    event = decode(encode(sign_step(step(1), KEY)), StepEvent)  # a fresh object, as decoded
    digests[0] = 0
    assert [step_signature_problem(event, KEY) for _ in range(4)] == [None] * 4
    assert digests[0] == 1


def test_the_trainers_own_signature_marks_its_event(digests):
    signed = sign_step(step(1), KEY)
    assert step_signature_problem(signed, KEY) is None
    assert digests[0] == 1  # the signing itself, no check


def test_a_mark_holds_for_its_key_only():
    signed = sign_step(step(1), KEY)
    assert "bad signature" in step_signature_problem(signed, "another-key")
    assert step_signature_problem(signed, KEY) is None


def test_twins_and_altered_copies_of_a_marked_event_are_checked_in_full():
    signed = sign_step(step(1), KEY)
    assert step_signature_problem(signed, KEY) is None
    # The same signature on other values, built anew or copied: not the marked object.
    forged = StepEvent(**{**signed.model_dump(), "loss": math.nan})
    altered = signed.model_copy(update={"loss": math.nan})
    for event in (forged, altered):
        assert event.signature == signed.signature
        assert "bad signature" in step_signature_problem(event, KEY)
    # An equal twin (the same bytes decoded again) verifies on its own merits.
    twin = decode(encode(signed), StepEvent)
    assert twin is not signed and step_signature_problem(twin, KEY) is None


def test_failed_and_unsigned_checks_leave_no_mark():
    bad = sign_step(step(1), "attacker-key")
    VERIFIED_STEPS.clear()
    assert step_signature_problem(bad, KEY) is not None
    assert step_signature_problem(step(2), KEY) is not None
    assert len(VERIFIED_STEPS) == 0


def test_subclasses_are_never_marked():
    class Loose(StepEvent):  # a subclass may be made mutable after its check
        model_config = {**StepEvent.model_config, "frozen": False}

    loose = Loose(**sign_step(step(1), KEY).model_dump())
    VERIFIED_STEPS.clear()
    assert step_signature_problem(loose, KEY) is None
    assert len(VERIFIED_STEPS) == 0
    loose.loss = math.nan
    assert "bad signature" in step_signature_problem(loose, KEY)


def test_marks_are_bounded_oldest_first():
    marks = VerifiedSteps(capacity=3)
    events = [sign_step(step(s), KEY) for s in range(5)]
    for event in events:
        marks.mark(event, KEY)
    assert len(marks) == 3
    assert [marks.holds(e, KEY) for e in events] == [False, False, True, True, True]


def test_the_mark_remembers_no_key():
    marks = VerifiedSteps()
    marks.mark(sign_step(step(1), KEY), KEY)
    assert not any(KEY.encode() in repr(v).encode() for v in marks._marks.values())


def test_on_the_embedded_bus_four_stages_hash_each_step_once_and_still_refuse_forgeries(digests):
    """Objects handed over as is: genuine ones pass every stage on one HMAC, forged ones go to the DLQ."""
    bus = EmbeddedBus(partitions=1)
    settings = load_settings({"topic_prefix": TOPICS.prefix, "signing_key": KEY}, env={})
    workers = [
        Worker(bus, build_stage(name, settings, TOPICS), snapshots=False) for name in DETECTORS
    ]
    genuine = [decode(encode(sign_step(step(s), KEY)), StepEvent) for s in range(10)]
    marked = sign_step(step(10), KEY)
    forged = [
        step(11, math.nan),  # unsigned
        sign_step(step(12, math.nan), "attacker-key"),  # another key (marked under that key only)
        marked.model_copy(update={"step": 13, "loss": math.nan}),  # a marked event, altered
        StepEvent(**{**marked.model_dump(), "step": 14, "loss": math.nan}),  # its signature, copied
    ]
    digests[0] = 0
    producer = bus.producer()
    for event in (
        genuine + [marked] + forged
    ):  # the objects themselves, as the Guard hands them over
        producer.publish(TOPICS.steps, encode(event), key=event.run_id, event=event)
    producer.flush()
    while sum(w.run_once(timeout=0) for w in workers):
        pass

    # The 10 decoded genuine steps once each, the 3 signed forgeries once per stage; the
    # trainer-signed step and the unsigned one never. Then each of the 11 verdicts per
    # detector is signed once by its worker.
    assert digests[0] == 10 + 3 * len(DETECTORS) + 11 * len(DETECTORS)
    dead = [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]
    for detector in DETECTORS:
        mine = [d for d in dead if d.consumer == f"{TOPICS.prefix}{detector}"]
        assert [decode(d.value, StepEvent).step for d in mine] == [11, 12, 13, 14]
        assert {d.error for d in mine} == {"StepNotAuthenticated"}
    verdicts = [r for r in bus.read_all(TOPICS.verdicts)]
    assert len(verdicts) == 11 * len(DETECTORS)  # every genuine step judged by every detector
