"""One Signer per process: the key, held once, signs and checks (schemas/signing.py).

The Guard reads its key once into ``guard.signer`` and hands that object to
everything that checks an action: its action queue and its protection watch;
its publisher signs with the same key.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import SecretStr

from spikeguard.bus import EmbeddedBus
from spikeguard.schemas import Action, ActionKind, Decision, StepEvent
from spikeguard.schemas.signing import Keyring, Role, Signer, sign, sign_action

KEY = SecretStr("signer-test-key-0123456789")


def _action() -> Action:
    return Action(
        action_id="a-1", run_id="r", kind=ActionKind.STOP, apply_at_step=3, params={"reason": "x"}
    )


def test_without_a_key_it_signs_nothing_and_accepts_everything() -> None:
    signer = Signer()
    step = StepEvent(run_id="r", step=1, loss=1.0)
    assert not signer.enabled and signer.sign(step) is step
    assert signer.problem(step) is None and signer.verifies(_action())


def test_with_a_key_it_signs_what_its_owner_produces_and_refuses_the_rest() -> None:
    signer = Signer(KEY)
    unsigned = StepEvent(run_id="r", step=1, loss=1.0)
    step = signer.sign(unsigned)
    assert signer.enabled and step.signature == sign(unsigned, KEY).signature
    assert signer.sign(step) is step  # signed already: as it is
    assert signer.problem(step) is None
    assert "no signature" in signer.problem(StepEvent(run_id="r", step=2, loss=1.0))
    assert "bad signature" in signer.problem(
        sign(StepEvent(run_id="r", step=3, loss=1.0), "another-key")
    )
    assert signer.verifies(sign_action(_action(), KEY))
    assert not signer.verifies(_action()) and not signer.verifies(
        sign_action(_action(), "another-key")
    )


def test_a_keyring_signs_each_record_with_its_role_key() -> None:
    ring = Keyring(
        {Role.TRAINER: "trainer-key", Role.FUSION: "fusion-key", Role.ACTUATOR: "actuator-key"}
    )
    signer = Signer(ring)
    unsigned = Decision(decision_id="d", run_id="r", step=1, is_anomaly=False)
    assert signer.sign(unsigned).signature == sign(unsigned, "fusion-key").signature
    assert signer.verifies(sign_action(_action(), "actuator-key"))
    assert not signer.verifies(sign_action(_action(), "trainer-key"))


def test_the_guard_holds_its_key_once_and_hands_the_same_signer_around(tmp_path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "producers"))
    from producers_helpers import Tiny, make_guard

    bus = EmbeddedBus()
    guard = make_guard(Tiny(), bus, tmp_path, signing_key=KEY)
    try:
        assert guard.signer.key == KEY
        assert guard.actions.signer is guard.signer
        assert guard.inbox.protection.signer is guard.signer
        assert guard.publisher.signing_key is guard.signer.key
    finally:
        guard.close()
        bus.close()
