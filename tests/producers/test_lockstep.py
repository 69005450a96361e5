"""Lockstep waits for the pipeline's own decision of a step, not for a record that claims to be it.

Anyone who can write the decisions topic could otherwise answer the trainer's wait first: the
guard would go on before the real decision (a run that is no longer reproducible) and, for a
forged anomalous decision, wait out its settle time for actions that never come, once per
forgery. With a key that checks decisions, an unsigned or wrongly signed decision is not one.
"""

from __future__ import annotations

import time

from spikeguard.bus.embedded import EmbeddedBus
from spikeguard.producers.lockstep import DecisionWaiter
from spikeguard.schemas import AnomalyType, Decision, Topics, encode
from spikeguard.schemas.signing import Keyring, Role, Signer, sign

KEY = "lockstep-test-key-" + "7" * 16
RUN = "lockstep-run"


def decision(step: int, anomalous: bool, decision_id: str) -> Decision:
    return Decision(
        decision_id=decision_id,
        run_id=RUN,
        step=step,
        is_anomaly=anomalous,
        critical=anomalous,
        type=AnomalyType.NON_FINITE if anomalous else AnomalyType.NONE,
        confidence=1.0,
    )


def waiter_after(records: list[Decision], signer: Signer | None) -> DecisionWaiter:
    bus, topics = EmbeddedBus(), Topics()
    waiter = DecisionWaiter(bus, topics, RUN, timeout=5.0, signer=signer)
    producer = bus.producer()
    for record in records:
        producer.publish(topics.decisions, encode(record), key=RUN)
    return waiter


def test_a_forged_decision_published_after_the_real_one_does_not_replace_it():
    real = sign(decision(5, False, "real-5"), KEY)
    unsigned = decision(5, True, "forged-5")
    guessed = sign(decision(5, True, "guessed-5"), "guessed-key")
    waiter = waiter_after([real, unsigned, guessed], Signer(KEY))
    assert waiter.wait(0, 5).decision_id == "real-5"


def test_a_forged_anomalous_decision_does_not_make_the_guard_wait_out_its_settle_time():
    real = sign(decision(5, False, "real-5"), KEY)
    forged = decision(5, True, "forged-5")
    waiter = waiter_after([real, forged], Signer(KEY))
    began = time.monotonic()
    waiter.follow(_NoActions(), 0, 5, settle=10.0)
    # A forged anomalous decision taken for the real one would hold the step for the whole 10 s.
    assert time.monotonic() - began < 5.0
    assert waiter.wait(0, 5).decision_id == "real-5"


def test_without_a_key_for_decisions_every_decision_is_taken():
    # No key at all (an insecure run), or a keyring without fusion's key (nothing to check
    # decisions with): lockstep still follows the pipeline.
    forged = decision(5, True, "unsigned-5")
    assert waiter_after([forged], None).wait(0, 5).decision_id == "unsigned-5"
    trainer_only = Signer(Keyring({Role.TRAINER: KEY, Role.ACTUATOR: KEY}))
    assert waiter_after([forged], trainer_only).wait(0, 5).decision_id == "unsigned-5"


class _NoActions:
    """An action inbox that never receives one (follow's settle loop polls it)."""

    _ready: list = []

    def poll_now(self, timeout: float) -> None:
        time.sleep(timeout)  # not a wait: a poll that finds nothing takes its timeout
