"""A genuine record of another trainer session, or one further ahead than a trainer runs, moves nothing.

The whole pipeline (the four real detectors, fusion, the actuator) runs on the
embedded bus with a signing key. Every record below is genuinely signed with
the run's key: what stops the hostile ones is the session they name (an
earlier run of the same run id) or how far they jump, not their signature.
"""

from __future__ import annotations

import math

import pytest

from spikeguard.bus import EmbeddedBus
from spikeguard.components import COMPONENTS, build_stage
from spikeguard.schemas import (
    Action,
    ActionKind,
    DeadLetter,
    Decision,
    RunEvent,
    StepEvent,
    Topics,
    decode,
    encode,
    new_session,
)
from spikeguard.schemas.signing import sign
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

KEY = "session-test-key-0123456789"
TOPICS = Topics("session-test.")
DETECTORS = ("statistical", "rules", "ml", "predictor")
pytestmark = pytest.mark.heavy  # ~5 s each: every record through six workers, one at a time
EARLIER, LATER = new_session(now=1_000.0), new_session(now=2_000.0)


def steps(session: str, numbers: range, epoch: int = 0, t0: float = 1_000.0) -> list[StepEvent]:
    return [
        sign(
            StepEvent(
                run_id="r",
                session=session,
                step=s,
                epoch=epoch,
                time=t0 + s,
                loss=2.0 - 0.001 * s,
                grad_norm=1.0,
                lr=1e-3,
            ),
            KEY,
        )
        for s in numbers
    ]


def nan_step(session: str, step: int, t0: float = 1_000.0) -> StepEvent:
    return sign(
        StepEvent(
            run_id="r",
            session=session,
            step=step,
            time=t0 + step,
            loss=math.nan,
            grad_norm=math.nan,
            lr=1e-3,
        ),
        KEY,
    )


def run_event(session: str, kind: str, step: int = 0) -> RunEvent:
    return sign(RunEvent(run_id="r", session=session, kind=kind, step=step), KEY)


def pipeline(records: list) -> EmbeddedBus:
    """Publish ``records`` in order (steps on steps, run events on runs), run every worker dry."""
    bus = EmbeddedBus(partitions=1)
    settings = load_settings({"topic_prefix": TOPICS.prefix, "signing_key": KEY}, env={})
    workers = [
        Worker(bus, build_stage(name, settings, TOPICS), snapshots=False) for name in COMPONENTS
    ]
    producer = bus.producer()
    for record in records:
        topic = TOPICS.runs if isinstance(record, RunEvent) else TOPICS.steps
        producer.publish(topic, encode(record), key=record.run_id)
        # Run events and steps travel on two topics: each record is handled before the next
        # is sent, as a trainer's records are when the pipeline keeps up.
        while sum(w.run_once(timeout=0) for w in workers):
            pass
    for worker in workers:
        worker.drain()
        while sum(w.run_once(timeout=0) for w in workers):
            pass
    return bus


def acted_on(bus: EmbeddedBus) -> list[Action]:
    decoded = (decode(r.value, Action) for r in bus.read_all(TOPICS.actions))
    return [a for a in decoded if a.kind is not ActionKind.PULSE and a.claim is not None]


def letters(bus: EmbeddedBus) -> list[DeadLetter]:
    return [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]


def decided(bus: EmbeddedBus) -> list[tuple]:
    return sorted(
        (d.session, d.epoch, d.step, d.is_anomaly, d.type.value)
        for d in (decode(r.value, Decision) for r in bus.read_all(TOPICS.decisions))
    )


def later_session_with_a_spike(extra: dict[int, list]) -> list:
    """The later session: its start, 100 healthy steps, a non-finite step at 100, 10 more;
    ``extra[i]`` is sent right after its step ``i``."""
    records: list = [run_event(LATER, "start")]
    for event in steps(LATER, range(100), t0=2_000.0):
        records.append(event)
        records += extra.get(event.step, [])
    records.append(nan_step(LATER, 100, t0=2_000.0))
    records += steps(LATER, range(101, 110), t0=2_000.0)
    return records


def earlier_session() -> list:
    return [
        run_event(EARLIER, "start"),
        *steps(EARLIER, range(120)),
        run_event(EARLIER, "end", 120),
    ]


def test_a_replayed_step_of_an_earlier_session_is_refused_and_the_later_session_stays_protected():
    earlier = earlier_session()
    replayed = earlier[-2]  # the earlier session's step 119, exactly as it was signed
    clean = pipeline(earlier + later_session_with_a_spike({}))
    attacked = pipeline(earlier + later_session_with_a_spike({50: [replayed], 80: earlier[:3]}))

    # The spike of the later session is acted on, as without the replay, for that session.
    assert acted_on(clean), "control: the non-finite step gets a rollback"
    assert [a.action_id for a in acted_on(attacked)] == [a.action_id for a in acted_on(clean)]
    assert {a.session for a in acted_on(attacked)} == {LATER}
    assert decided(attacked) == decided(clean)
    # Each detector refused the replayed steps; every stage refused the replayed start.
    dead = letters(attacked)
    assert {d.error for d in dead} == {"RecordOfOtherSession"}
    for detector in DETECTORS:
        mine = [d for d in dead if d.consumer == f"{TOPICS.prefix}{detector}"]
        assert len(mine) == 4, [d.reason for d in mine]  # step 299, the start, steps 0 and 1
        assert f"older than the run's session {LATER}" in mine[0].reason
    assert [d for d in dead if d.consumer.endswith(("fusion", "actuator"))]  # the start


def test_a_newer_session_starts_the_run_afresh_whatever_the_earlier_one_left():
    # The earlier session never ended (its trainer died at step 119): the later one, from step 0
    # of epoch 0 again, is judged and protected all the same.
    earlier = earlier_session()[:-1]
    bus = pipeline(earlier + later_session_with_a_spike({}))
    assert acted_on(bus) and {a.session for a in acted_on(bus)} == {LATER}
    assert letters(bus) == []
    later_steps = [d for d in decided(bus) if d[0] == LATER]
    assert len(later_steps) == 110  # every step of the later session decided


@pytest.mark.parametrize(
    "jump",
    [
        dict(step=500_000),  # +500,000 steps
        dict(step=70, epoch=999),  # epoch 999
        dict(step=10_000_000, time=1e12),  # a time far ahead does not pay for the steps
    ],
    ids=["step+500000", "epoch999", "future-time"],
)
def test_a_step_signed_with_the_trainer_key_that_jumps_the_run_ahead_is_refused(jump):
    forged = sign(
        StepEvent(
            run_id="r",
            session=LATER,
            time=jump.pop("time", 2_070.5),
            loss=2.0,
            grad_norm=1.0,
            lr=1e-3,
            **jump,
        ),
        KEY,
    )
    clean = pipeline(later_session_with_a_spike({}))
    attacked = pipeline(later_session_with_a_spike({70: [forged]}))

    assert acted_on(clean)
    assert [a.action_id for a in acted_on(attacked)] == [a.action_id for a in acted_on(clean)]
    assert decided(attacked) == decided(clean)
    dead = letters(attacked)
    assert len(dead) == len(DETECTORS) and {d.error for d in dead} == {"StepOutOfOrder"}
    assert "than a trainer" in dead[0].reason and "refused" in dead[0].reason
