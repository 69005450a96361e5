"""Forged steps cannot obtain signed actions, and replayed steps are refused.

The whole pipeline runs on the real embedded bus: the four real detectors,
fusion and the real actuator with its recovery policy, each in a Worker.
"""

from __future__ import annotations

import math

import pytest

from spikeguard.bus import EmbeddedBus
from spikeguard.components import COMPONENTS, build_stage
from spikeguard.schemas import (
    ActionKind,
    Action,
    DeadLetter,
    StepEvent,
    Topics,
    decode,
    encode,
    sign_step,
)
from spikeguard.schemas.signing import verify_action
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

KEY = "run-key-0123456789abcdef"
TOPICS = Topics("auth-test.")
DETECTORS = ("statistical", "rules", "ml", "predictor")


def healthy(run_id: str, steps: range, epoch: int = 0) -> list[StepEvent]:
    return [
        StepEvent(
            run_id=run_id,
            step=s,
            epoch=epoch,
            time=1000.0 + s,
            loss=2.0 - 0.001 * s,
            grad_norm=1.0,
            lr=1e-3,
        )
        for s in steps
    ]


def nan_step(run_id: str, step: int) -> StepEvent:
    return StepEvent(
        run_id=run_id, step=step, time=2000.0 + step, loss=math.nan, grad_norm=math.nan, lr=1e-3
    )


def run_pipeline(events: list[StepEvent], key: str | None = KEY) -> EmbeddedBus:
    bus = EmbeddedBus(partitions=2)
    settings = load_settings({"topic_prefix": TOPICS.prefix, "signing_key": key}, env={})
    workers = [
        Worker(bus, build_stage(name, settings, TOPICS), snapshots=False) for name in COMPONENTS
    ]
    producer = bus.producer()
    for event in events:
        producer.publish(TOPICS.steps, encode(event), key=event.run_id)
    drain(workers)
    return bus


def drain(workers: list[Worker]) -> None:
    """Every worker runs until none has input left; then fusion decides what it still holds."""
    while sum(w.run_once(timeout=0) for w in workers):
        pass
    for w in workers:
        w.drain()
        while sum(x.run_once(timeout=0) for x in workers):
            pass


def actions(bus: EmbeddedBus) -> list[Action]:
    """The actions that act on the run (the actuator's pulses only say it is being judged)."""
    decoded = (decode(r.value, Action) for r in bus.read_all(TOPICS.actions))
    return [a for a in decoded if a.kind is not ActionKind.PULSE]


def letters(bus: EmbeddedBus) -> list[DeadLetter]:
    return [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]


def forged_three(victim: str) -> list[StepEvent]:
    """Unsigned, signed with another key, and a genuine signature over altered values."""
    genuine = sign_step(healthy(victim, range(22, 23))[0], KEY)
    tampered = genuine.model_copy(update={"loss": math.nan, "grad_norm": math.nan})
    return [nan_step(victim, 20), sign_step(nan_step(victim, 21), "attacker-key"), tampered]


def test_three_forged_nan_steps_get_no_signed_action_and_land_in_the_dlq():
    victim = [sign_step(e, KEY) for e in healthy("victim", range(20))]
    bus = run_pipeline(victim + forged_three("victim"))

    assert actions(bus) == []
    dead = letters(bus)
    for detector in DETECTORS:  # each detector group refuses each of the three
        mine = [d for d in dead if d.consumer == f"{TOPICS.prefix}{detector}"]
        assert [d.error for d in mine] == ["StepNotAuthenticated"] * 3
        assert "unsigned" in mine[0].reason
        assert all("bad signature" in d.reason for d in mine[1:])
        assert all(decode(d.value, StepEvent).run_id == "victim" for d in mine)
    assert not [d for d in dead if d.error != "StepNotAuthenticated"]


def test_the_same_nan_steps_signed_by_the_trainer_are_acted_on():
    # The control: what the forgery would have bought without authentication.
    steps = healthy("victim", range(20)) + [nan_step("victim", s) for s in (20, 21, 22)]
    bus = run_pipeline([sign_step(e, KEY) for e in steps])
    got = actions(bus)
    assert got and all(a.run_id == "victim" and verify_action(a, KEY) for a in got)
    assert letters(bus) == []


def test_without_a_key_unsigned_steps_are_judged():
    # The explicit --insecure opt-out: nothing to check steps against.
    steps = healthy("victim", range(20)) + [nan_step("victim", s) for s in (20, 21, 22)]
    bus = run_pipeline(steps, key=None)
    assert actions(bus) and letters(bus) == []


# -- steps from the past and the far future -----------------------------------------


def decisions(bus: EmbeddedBus) -> list[tuple]:
    from spikeguard.schemas import Decision

    return sorted(
        (d.run_id, d.epoch, d.step, d.is_anomaly, d.type.value, d.critical)
        for d in (decode(r.value, Decision) for r in bus.read_all(TOPICS.decisions))
    )


@pytest.mark.parametrize("key", [KEY, None])
def test_backwards_duplicate_and_far_future_steps_land_in_the_dlq_and_change_nothing(key):
    sign = (lambda e: sign_step(e, key)) if key else (lambda e: e)
    run = healthy("r", range(40)) + [nan_step("r", 40)] + healthy("r", range(41, 60))
    # A rollback to step 30: epoch 1 re-runs 30..59 (admitted: a new epoch).
    run += healthy("r", range(30, 60), epoch=1)
    hostile = {
        25: healthy("r", range(10, 11)),  # backwards within epoch 0
        26: healthy("r", range(26, 27)),  # a duplicate of the step just judged
        45: [healthy("r", range(5_000_000, 5_000_001))[0]],  # far future, within the schema
        75: [nan_step("r", 20)],  # epoch 0 again, after epoch 1 began
        76: healthy("r", range(31, 32), epoch=5000),  # far-future epoch
    }
    mixed: list[StepEvent] = []
    for i, event in enumerate(run):
        mixed.append(sign(event))
        mixed += [sign(h) for h in hostile.get(i, [])]
    clean_bus, bus = run_pipeline([sign(e) for e in run], key), run_pipeline(mixed, key)

    assert decisions(bus) == decisions(clean_bus)  # the same decisions, every step
    assert [a.action_id for a in actions(bus)] == [a.action_id for a in actions(clean_bus)]
    for detector in DETECTORS:
        mine = [d for d in letters(bus) if d.consumer == f"{TOPICS.prefix}{detector}"]
        assert [d.error for d in mine] == ["StepOutOfOrder"] * 5
        assert [decode(d.value, StepEvent).step for d in mine] == [10, 26, 5_000_000, 20, 31]
        assert "not after step 25 of epoch 0" in mine[0].reason
        assert "step 26 of epoch 0 is not after step 26 of epoch 0" in mine[1].reason
        assert "more than a trainer runs" in mine[2].reason
        assert "not after step" in mine[3].reason and "epoch 1" in mine[3].reason
        assert "more than 16 epochs past" in mine[4].reason


def test_a_step_beyond_2_to_the_53_is_refused_by_the_schema_into_the_dlq():
    from spikeguard.errors import MalformedMessage
    from spikeguard.schemas import MAX_COUNTER

    assert (
        decode(encode(StepEvent(run_id="r", step=MAX_COUNTER, loss=1.0)), StepEvent).step
        == MAX_COUNTER
    )
    huge = b'{"run_id": "r", "step": 100000000000000000000000000000, "loss": "NaN"}'
    with pytest.raises(MalformedMessage, match="step"):
        decode(huge, StepEvent)
    bus = EmbeddedBus(partitions=1)
    settings = load_settings({"topic_prefix": TOPICS.prefix}, env={})
    worker = Worker(bus, build_stage("rules", settings, TOPICS), snapshots=False)
    bus.producer().publish(TOPICS.steps, huge, key="r")
    while worker.run_once(timeout=0):
        pass
    (letter,) = letters(bus)
    assert (
        letter.error == "MalformedMessage"
        and "less than or equal to 9007199254740991" in letter.reason
    )


def test_a_run_restored_from_a_snapshot_is_judged_again_from_its_offsets():
    # After a restart or a rewind the worker seeks back to the snapshot's offsets:
    # those replays are the steps to judge again, not steps out of order.
    from spikeguard.errors import StepOutOfOrder

    stage = build_stage("rules", load_settings({"topic_prefix": TOPICS.prefix}, env={}), TOPICS)
    steps = healthy("r", range(10))
    for step in steps[:5]:
        stage.admit(TOPICS.steps, step)
        stage.handle_batch([(TOPICS.steps, step)])
    saved = stage.snapshot({"r"})
    assert saved
    for step in steps[5:]:
        stage.admit(TOPICS.steps, step)
        stage.handle_batch([(TOPICS.steps, step)])
    with pytest.raises(StepOutOfOrder):
        stage.admit(TOPICS.steps, steps[5])
    stage.restore(saved)
    stage.admit(TOPICS.steps, steps[5])  # admitted again
