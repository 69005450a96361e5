"""The trainer refuses an action whose evidence it did not publish itself.

A real Guard trains a real model on the embedded bus; actions signed with the
run's key arrive while it trains. The signature is good on all of them: only
their evidence tells the forged ones apart.
"""

from __future__ import annotations

import math

from producers_helpers import Tiny, acks, action, make_guard, send, train

from spikeguard.producers.actions import PublishedSteps
from spikeguard.schemas import AckStatus, ActionKind, Evidence, StepEvent, Topics, decode
from spikeguard.schemas.signing import sign_action

KEY = "guard-evidence-key"


def _with_evidence(kind: ActionKind, at: int, evidence: Evidence, **params):
    bare = action(kind, at, **params)
    return sign_action(bare.model_copy(update={"evidence": evidence}), KEY)


def test_actions_with_evidence_the_trainer_did_not_publish_are_rejected_and_not_applied(
    bus, tmp_path
):
    tiny = Tiny(seed=5)
    guard = make_guard(tiny, bus, tmp_path, signing_key=KEY)
    train(guard, tiny, 6)
    published = {
        e.step: e for e in (decode(r.value, StepEvent) for r in bus.read_all(Topics().steps))
    }
    real = published[4]
    forged_loss = _with_evidence(
        ActionKind.SCALE_LR,
        7,
        Evidence(step=4, loss=math.nan, grad_norm=real.grad_norm),
        factor=0.001,
    )
    forged_grad = _with_evidence(
        ActionKind.STOP,
        7,
        Evidence(step=4, loss=real.loss, grad_norm=(real.grad_norm or 0.0) * 50),
        reason="forged",
    )
    future = _with_evidence(
        ActionKind.SET_LR, 7, Evidence(step=400, loss=math.nan, grad_norm=math.nan), lr=1e-9
    )
    other_epoch = _with_evidence(
        ActionKind.SET_LR,
        7,
        Evidence(step=4, epoch=3, loss=real.loss, grad_norm=real.grad_norm),
        lr=1e-9,
    )
    genuine = _with_evidence(
        ActionKind.SCALE_LR,
        8,
        Evidence(step=real.step, epoch=real.epoch, loss=real.loss, grad_norm=real.grad_norm),
        factor=0.5,
    )
    send(bus, forged_loss, forged_grad, future, other_epoch, genuine, guard=guard)
    train(guard, tiny, 10)
    guard.close()

    by_id = {a.action_id: a for a in acks(bus)}
    for forged, words in (
        (forged_loss, "evidence loss nan"),
        (forged_grad, "evidence grad_norm"),
        (future, "did not publish"),
        (other_epoch, "did not publish"),
    ):
        ack = by_id[forged.action_id]
        assert ack.status is AckStatus.REJECTED, ack
        assert words in ack.result and "refused" in ack.result
    assert by_id[genuine.action_id].status is AckStatus.APPLIED
    # Nothing forged took effect: no stop, the LR only halved by the genuine action.
    assert not guard.should_stop and guard.step_count == 10
    assert guard.counters["actions_applied"] == 1
    after = {e.step: e for e in (decode(r.value, StepEvent) for r in bus.read_all(Topics().steps))}
    assert after[9].lr == after[7].lr / 2 == 5e-3


def test_the_published_window_is_bounded_and_forgets_the_oldest():
    window = PublishedSteps(size=3)
    for step in range(10):
        window.remember(0, step, float(step), None)
    assert len(window) == 3
    assert window.problem(Evidence(step=9, loss=9.0)) is None
    assert "did not publish" in window.problem(Evidence(step=6, loss=6.0))
    window.remember(0, 10, math.nan, math.inf)
    assert window.problem(Evidence(step=10, loss=math.nan, grad_norm=math.inf)) is None
