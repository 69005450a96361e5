"""Separate keys per role: a leaked detectors key signs verdicts, never a decision or an action.

The real actuator stage and trainer-side action check, built from settings as their processes
build them (``SPIKEGUARD_<ROLE>_KEY``), on the embedded bus, records published as bytes. One
shared ``signing_key`` stays the default: every role then signs with it.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import build_stage
from spikeguard.metrics import Metrics
from spikeguard.schemas import (
    Action,
    ActionKind,
    AnomalyType,
    CheckpointEvent,
    DeadLetter,
    Decision,
    Evidence,
    Topics,
    decision_id,
    decode,
)
from spikeguard.schemas.signing import (
    Keyring,
    Role,
    sign,
    sign_action,
    signature_problem,
    verify_action,
)
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker


from .test_actuator_trust import publish

KEYS = {
    "trainer_key": "trainer-key-0123456789abcdef",
    "detectors_key": "detectors-key-0123456789abcdef",
    "fusion_key": "fusion-key-0123456789abcdef",
    "actuator_key": "actuator-key-0123456789abcdef",
}
TOPICS = Topics("rolekeys.")
RUN = "victim"


def settings_with(**keys):
    return load_settings({"topic_prefix": TOPICS.prefix, **keys}, env={})


def actuator(bus: EmbeddedBus, settings) -> Worker:
    stage = build_stage("actuator", settings, TOPICS)
    return Worker(bus, stage, metrics=Metrics(CollectorRegistry()), snapshots=False)


def decision(step: int, anomaly: bool = False) -> Decision:
    fields = (
        dict(
            is_anomaly=True,
            critical=True,
            type=AnomalyType.NON_FINITE,
            confidence=1.0,
            incident_id=f"i{step}",
            incident_onset_step=step,
        )
        if anomaly
        else dict(is_anomaly=False)
    )
    return Decision(
        decision_id=decision_id(RUN, step),
        run_id=RUN,
        step=step,
        evidence=Evidence(step=step, loss=math.nan if anomaly else 1.0, grad_norm=1.0),
        **fields,
    )


def run_with(decision_key: str) -> tuple[list[Action], list[DeadLetter]]:
    """A checkpoint, a healthy stretch and a recurring non-finite step (a rollback is due), the
    decisions signed with ``decision_key``, through an actuator holding the role keys."""
    bus = EmbeddedBus(partitions=1)
    worker = actuator(bus, settings_with(**KEYS))
    checkpoint = CheckpointEvent(run_id=RUN, step=20, checkpoint_id="c20", healthy=True)
    publish(bus, worker, (TOPICS.checkpoints, sign(checkpoint, KEYS["trainer_key"])))
    publish(
        bus, worker, *[(TOPICS.decisions, sign(decision(s), decision_key)) for s in range(21, 150)]
    )
    publish(
        bus,
        worker,
        *[(TOPICS.decisions, sign(decision(s, anomaly=True), decision_key)) for s in (150, 151)],
    )
    actions = [decode(r.value, Action) for r in bus.read_all(TOPICS.actions)]
    return actions, [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]


def test_a_decision_signed_with_the_detectors_key_is_refused_naming_the_fusion_role():
    actions, letters = run_with(KEYS["detectors_key"])
    assert not [a for a in actions if a.kind is ActionKind.ROLLBACK]
    assert len(letters) == 131 and {d.source_topic for d in letters} == {TOPICS.decisions}
    reason = letters[-1].reason
    assert letters[-1].error == "RecordNotAuthenticated"
    assert "bad signature" in reason and "only the fusion key signs decisions" in reason, reason


@pytest.mark.heavy
def test_decisions_signed_with_the_fusion_key_roll_back_and_the_actions_carry_the_actuator_key():
    actions, letters = run_with(KEYS["fusion_key"])
    (rollback,) = [a for a in actions if a.kind is ActionKind.ROLLBACK]
    assert rollback.params.checkpoint_id == "c20" and not letters
    assert verify_action(rollback, KEYS["actuator_key"])
    assert not verify_action(rollback, KEYS["fusion_key"]) and not verify_action(
        rollback, KEYS["detectors_key"]
    )


def test_a_detector_host_holding_its_own_key_and_the_trainers_cannot_sign_a_decision_or_an_action():
    """What a detectors process holds (its key, the trainer's to check steps): nothing that steers."""
    detector_host = settings_with(
        trainer_key=KEYS["trainer_key"], detectors_key=KEYS["detectors_key"]
    ).keys()
    assert isinstance(detector_host, Keyring) and detector_host.roles == {
        Role.TRAINER,
        Role.DETECTORS,
    }
    try:
        sign(decision(5), detector_host)
    except ValueError as exc:
        assert "holds no fusion key" in str(exc)
    else:
        raise AssertionError("a detectors host signed a decision")
    stop = Action(action_id="a-x", run_id=RUN, kind=ActionKind.STOP, apply_at_step=6)
    try:
        sign_action(stop, detector_host)
    except ValueError as exc:
        assert "holds no actuator key" in str(exc)
    else:
        raise AssertionError("a detectors host signed an action")
    trainer = settings_with(**KEYS).keys()
    forged = sign_action(stop, KEYS["detectors_key"])  # the leaked key, used directly
    assert not verify_action(forged, trainer)
    assert "only the actuator key signs actions" in signature_problem(forged, trainer)


def test_one_shared_key_is_the_default_and_a_role_without_its_own_key_uses_it():
    assert (
        settings_with(signing_key="shared-key-0123456789abcdef").keys().get_secret_value()
        == "shared-key-0123456789abcdef"
    )
    mixed = settings_with(
        signing_key="shared-key-0123456789abcdef", actuator_key=KEYS["actuator_key"]
    ).keys()
    assert isinstance(mixed, Keyring) and mixed.roles == set(Role)
    made = sign(decision(5), mixed)
    assert signature_problem(made, "shared-key-0123456789abcdef") is None  # fusion: the shared key
    assert "actuator" in repr(mixed) and "key-0123" not in repr(mixed)
