"""Run events are signed like step events: the run's key, canonical fields, wire-compatible."""

from __future__ import annotations

import json

import pytest

from spikeguard.bus import EmbeddedBus
from spikeguard.producers.publisher import BackgroundPublisher
from spikeguard.schemas import RunEvent, StepEvent, Topics, decode, encode
from spikeguard.schemas.signing import run_event_signature_problem, sign_run_event

KEY = "run-event-key-0123456789abcdef"


def start() -> RunEvent:
    return RunEvent(
        run_id="r",
        kind="start",
        preset="small",
        policy={"rollback_min_steps_before_onset": 40, "lr_decrease_factor_spike": 0.25},
        fusion={"threshold": 0.6, "weights": {"ml": 0.25}},
        checkpoint_every=50,
        keep_checkpoints=4,
        planned_steps=1000,
        time=1234.5678,
    )


def test_a_signed_run_event_verifies_after_the_wire_and_signing_is_deterministic():
    signed = sign_run_event(start(), KEY)
    assert signed.signature and len(signed.signature) == 64
    assert sign_run_event(start(), KEY).signature == signed.signature
    assert run_event_signature_problem(decode(encode(signed), RunEvent), KEY) is None
    assert start().signature is None  # optional, None by default


def test_a_record_from_before_signing_still_decodes_and_is_refused_only_for_its_missing_signature():
    old = json.loads(encode(start()))
    del old["signature"]
    event = decode(json.dumps(old).encode(), RunEvent)
    assert event.signature is None and event.policy == start().policy
    assert run_event_signature_problem(event, KEY).startswith("no signature")


@pytest.mark.parametrize(
    "change",
    [
        {"policy": {"rollback_min_steps_before_onset": 1_000_000}},
        {"fusion": {"threshold": 1.0}},
        {"kind": "end"},
        {"run_id": "someone-else"},
        {"step": 7},
        {"preset": None},
    ],
)
def test_any_altered_field_or_another_key_breaks_the_signature(change):
    signed = sign_run_event(start(), KEY)
    assert run_event_signature_problem(signed.model_copy(update=change), KEY).startswith(
        "bad signature"
    )
    assert run_event_signature_problem(signed, "another-key").startswith("bad signature")


def test_the_trainers_publisher_signs_run_events_with_the_runs_key_and_not_without_one():
    topics = Topics("sign-pub.")
    for key in (KEY, None):
        bus = EmbeddedBus(partitions=1)
        publisher = BackgroundPublisher(bus.producer(), "r", threaded=False, signing_key=key)
        publisher.submit(
            topics.runs,
            RunEvent,
            dict(run_id="r", kind="start", policy={"max_incidents": 3}),
            droppable=False,
        )
        publisher.submit(topics.steps, StepEvent, dict(run_id="r", step=0, loss=1.0))
        (record,) = bus.read_all(topics.runs)
        event = decode(record.value, RunEvent)
        if key is None:  # a keyless trainer (--insecure): as before, unsigned
            assert event.signature is None
        else:
            assert run_event_signature_problem(event, KEY) is None
