"""The trainer trusts its own numbers: a decision's actions change the run only if the trainer agrees.

A real Guard trains a real model on the embedded bus, with a signing key. The
recovery policy (the actuator's own code) turns decisions into actions, which
are signed with the run's key as the actuator signs them: the signature is
good on all of them. Forged decisions copy their evidence from what the
trainer published on the steps topic, as an attacker who can read ``steps``
and write ``decisions`` would.
"""

from __future__ import annotations

import math

import pytest
from producers_helpers import Tiny, acks, make_guard, send

from spikeguard.actuators.config import PolicyConfig
from spikeguard.actuators.policy import RecoveryPolicy
from spikeguard.producers.evidence import AGREE_Z, PublishedSteps, StepView, disagreement
from spikeguard.schemas import (
    AckStatus,
    ActionKind,
    AnomalyType,
    CheckpointEvent,
    Claim,
    Decision,
    Evidence,
    StepEvent,
    Topics,
    decode,
)
from spikeguard.schemas.signing import sign_action

KEY = "own-numbers-key"
LR = 1e-2
STATE_CHANGING = {
    ActionKind.ROLLBACK,
    ActionKind.SKIP_BATCHES,
    ActionKind.SCALE_LR,
    ActionKind.SET_LR,
    ActionKind.CLIP,
    ActionKind.STOP,
    ActionKind.SET_EPS,
}


def published(bus) -> dict[tuple[int, int], StepEvent]:
    events = (decode(r.value, StepEvent) for r in bus.read_all(Topics().steps))
    return {(e.epoch, e.step): e for e in events}


def evidence_of(event: StepEvent) -> Evidence:
    return Evidence(step=event.step, epoch=event.epoch, loss=event.loss, grad_norm=event.grad_norm)


def signed_plan(bus, decision: Decision) -> list:
    """What the actuator would publish for ``decision``: the policy's actions, signed. (The policy
    answers at once: a non-finite step as for a loop that does not skip it, a bad batch as such; what
    is under test is the trainer's check, not the policy's patience.)"""
    policy = RecoveryPolicy(
        PolicyConfig(rollback_min_steps_before_onset=5, non_finite_skipped_by_trainer=False),
        run_id=decision.run_id,
    )
    for record in bus.read_all(Topics().checkpoints):
        policy.on_checkpoint(decode(record.value, CheckpointEvent))
    return [sign_action(a, KEY) for a in policy.on_decision(decision)]


def critical(step: int, epoch: int, kind: AnomalyType, evidence: Evidence) -> Decision:
    return Decision(
        decision_id=f"d-{kind.value}-{step}",
        run_id="r1",
        step=step,
        epoch=epoch,
        is_anomaly=True,
        type=kind,
        confidence=1.0,
        critical=True,
        incident_id=f"inc-{step}",
        incident_onset_step=step,
        evidence=evidence,
    )


def run(guard, tiny, steps: int, poison=None) -> None:
    """Train to ``steps``; ``poison(step)`` may scale a step's targets (a real spike) or make them NaN."""
    data = guard.data(tiny.loader, max_steps=steps)
    while guard.step_count < steps and not guard.should_stop:
        for x, y in data:
            if poison is not None:
                y = poison(guard.step_count, guard.generation, y)
            guard.step(tiny.loss((x, y)))
    guard.publisher.flush(5.0)


def test_a_forged_critical_decision_for_the_next_step_with_the_newest_evidence_changes_nothing(
    bus, tmp_path
):
    tiny = Tiny(seed=11, lr=LR)
    guard = make_guard(tiny, bus, tmp_path, signing_key=KEY)
    run(guard, tiny, 40)
    clipping = guard.clipper.settings()
    newest = published(bus)[(0, 39)]
    # A decision for step N+1 carrying step N's evidence, and one for step N itself.
    next_step = signed_plan(bus, critical(40, 0, AnomalyType.NON_FINITE, evidence_of(newest)))
    same_step = signed_plan(bus, critical(39, 0, AnomalyType.BAD_BATCH, evidence_of(newest)))
    forged = next_step + same_step
    assert {a.kind for a in next_step} >= {
        ActionKind.ROLLBACK,
        ActionKind.SKIP_BATCHES,
        ActionKind.SCALE_LR,
        ActionKind.CLIP,
    }
    send(bus, *forged, guard=guard)
    run(guard, tiny, 80)
    guard.close()

    by_id = {a.action_id: a for a in acks(bus)}
    for a in forged:
        if a.kind in STATE_CHANGING:
            ack = by_id[a.action_id]
            assert ack.status is AckStatus.REJECTED, (a.kind, ack)
            assert "refused" in ack.result
    for a in next_step:
        if a.kind in STATE_CHANGING:
            assert "its evidence is of step 39" in by_id[a.action_id].result
    for a in same_step:
        if a.kind in STATE_CHANGING:
            assert "this trainer saw" in by_id[a.action_id].result
    # The healthy run was left alone: same LR, no rollback, no skipped data, no clipping.
    steps = published(bus)
    assert guard.counters["rollbacks"] == 0 and guard.generation == 0 and guard.step_count == 80
    assert guard.counters["skipped_batches"] == 0 and guard.position.skip_ranges == []
    assert steps[(0, 79)].lr == LR
    assert guard.clipper.settings() == clipping


@pytest.mark.parametrize("kind", [AnomalyType.NON_FINITE, AnomalyType.BAD_BATCH])
def test_a_real_anomaly_decision_is_applied_whole(bus, tmp_path, kind):
    tiny = Tiny(seed=12, lr=LR)
    guard = make_guard(tiny, bus, tmp_path, signing_key=KEY)
    bad_step = 45

    def poison(step, epoch, y):
        if (step, epoch) != (bad_step, 0):
            return y
        return y * math.nan if kind is AnomalyType.NON_FINITE else y * 40.0

    run(guard, tiny, bad_step + 1, poison)
    bad = published(bus)[(0, bad_step)]
    assert (
        (not math.isfinite(bad.loss))
        if kind is AnomalyType.NON_FINITE
        else bad.skip_reason == "outlier_step"
    )
    plan = signed_plan(bus, critical(bad_step, 0, kind, evidence_of(bad)))
    send(bus, *plan, guard=guard)
    run(guard, tiny, 70, poison)
    guard.close()

    by_id = {a.action_id: a for a in acks(bus)}
    for a in plan:
        assert by_id[a.action_id].status is AckStatus.APPLIED, (a.kind, by_id[a.action_id])
    assert guard.counters["rollbacks"] == 1 and guard.generation == 1
    assert guard.counters["skipped_batches"] > 0
    assert published(bus)[(1, 69)].lr < LR


def view(loss_z=None, grad_z=None, non_finite=False, overflow=False) -> StepView:
    return StepView(1.0, 1.0, non_finite, overflow, loss_z, grad_z)


def test_agreement_is_a_lower_bar_than_skipping_and_keyed_by_type():
    spike = Claim(step=5, type=AnomalyType.LOSS_SPIKE)
    assert AGREE_Z < 1.0  # the skip threshold is at score 1.0
    assert disagreement(spike, view(loss_z=AGREE_Z)) is None
    assert disagreement(spike, view(grad_z=AGREE_Z + 1)) is None
    assert disagreement(spike, view(non_finite=True)) is None
    assert "loss_spike" in disagreement(spike, view(loss_z=AGREE_Z - 0.1))
    assert disagreement(spike, view()) is not None  # not scored, or not above its baseline
    nan = Claim(step=5, type=AnomalyType.NON_FINITE)
    assert disagreement(nan, view(non_finite=True)) is None
    assert (
        disagreement(nan, view(loss_z=50.0)) is not None
    )  # far out, but finite: not what was claimed
    assert disagreement(nan, view(overflow=True)) is not None  # a GradScaler's overflow is normal
    collapse = Claim(step=5, type=AnomalyType.LOSS_SCALE_COLLAPSE)
    assert disagreement(collapse, view(overflow=True)) is None


@pytest.mark.parametrize("kind", [AnomalyType.LR_OUT_OF_BOUNDS, AnomalyType.LR_INDUCED_RISE])
def test_an_lr_jump_the_trainer_saw_beyond_its_peak_backs_an_lr_claim(kind):
    """Issue 38: the re-run after an LR blow-up's rollback meets the schedule's jump again; the
    policy scales it back at once, before the loss can rise, claiming the jump itself. The trainer
    saw its own LR jump beyond any rate it had trained at: that backs the claim (a loss spike's
    claim it does not)."""
    jumped = StepView(1.0, 1.0, lr_beyond_peak=True)
    assert disagreement(Claim(step=5, type=kind), jumped) is None
    assert disagreement(Claim(step=5, type=kind), view()) is not None
    assert disagreement(Claim(step=5, type=AnomalyType.LOSS_SPIKE), jumped) is not None


def test_a_claim_must_be_of_its_evidences_step_and_epoch():
    steps = PublishedSteps(size=8)
    steps.remember(1, 4, 2.0, 0.5, view(loss_z=9.0))
    claim = Claim(step=4, epoch=1, type=AnomalyType.BAD_BATCH)
    assert steps.claim_problem(claim, Evidence(step=4, epoch=1, loss=2.0, grad_norm=0.5)) is None
    assert "epoch 0" in steps.claim_problem(
        claim, Evidence(step=4, epoch=0, loss=2.0, grad_norm=0.5)
    )
    assert "did not publish" in steps.claim_problem(
        Claim(step=5, epoch=1, type=AnomalyType.BAD_BATCH), None
    )
    # What was published is kept beside the judgement, for the evidence check.
    assert steps.view(1, 4).loss == 2.0 and steps.view(1, 4).loss_z == 9.0


def test_a_step_kept_as_own_views_arguments_is_checked_as_the_view_they_make():
    # The trainer keeps own_view's arguments per step and makes the view only when an action
    # cites the step: every check must read the same view as one kept whole.
    from spikeguard.producers.evidence import own_view
    from spikeguard.producers.skip_rule import SkipDecision

    scored = SkipDecision(True, "loss", 9.0, None, True)
    for judged in ((False, False, scored, False, 2.0, 0.5), (True, False, None, True, 2.0, None)):
        lazy, whole = PublishedSteps(size=2), PublishedSteps(size=2)
        lazy.keep(1, 4, judged)
        whole.keep(1, 4, own_view(*judged))
        assert lazy.view(1, 4) == whole.view(1, 4) == own_view(*judged)
        assert type(lazy.view(1, 4)) is StepView
        for evidence in (
            Evidence(step=4, epoch=1, loss=2.0, grad_norm=0.5),
            Evidence(step=4, epoch=1, loss=2.5, grad_norm=None),
            Evidence(step=4, epoch=1, loss=2.0, grad_norm=None),
        ):
            assert lazy.problem(evidence) == whole.problem(evidence)
        for kind in (AnomalyType.LOSS_SPIKE, AnomalyType.NON_FINITE, AnomalyType.BAD_BATCH):
            claim = Claim(step=4, epoch=1, type=kind)
            assert lazy.claim_problem(claim, None) == whole.claim_problem(claim, None)
        lazy.keep(1, 5, judged)
        lazy.keep(1, 6, judged)
        assert len(lazy) == 2 and lazy.view(1, 4) is None  # bounded, oldest out


def test_a_plan_whose_rollback_fails_applies_none_of_its_skip_lr_or_clipping(bus, tmp_path):
    tiny = Tiny(seed=13, lr=LR)
    guard = make_guard(tiny, bus, tmp_path, signing_key=KEY)
    bad_step = 45
    poison = lambda step, epoch, y: y * 40.0 if (step, epoch) == (bad_step, 0) else y  # noqa: E731
    run(guard, tiny, bad_step + 1, poison)
    clipping = guard.clipper.settings()
    bad = evidence_of(published(bus)[(0, bad_step)])
    plan = signed_plan(bus, critical(bad_step, 0, AnomalyType.BAD_BATCH, bad))
    assert [a.kind for a in plan][:2] == [ActionKind.ROLLBACK, ActionKind.SKIP_BATCHES]
    guard.saver.wait()
    for info in guard.store.list():  # every checkpoint truncated: the rollback cannot read any
        with open(info.path, "r+b") as handle:
            handle.truncate(64)
    send(bus, *plan, guard=guard)
    run(guard, tiny, 70, poison)
    guard.close()

    by_id = {a.action_id: a for a in acks(bus)}
    rollback, rest = plan[0], [a for a in plan[1:] if a.kind in STATE_CHANGING]
    assert by_id[rollback.action_id].status is AckStatus.FAILED
    assert {a.kind for a in rest} >= {ActionKind.SKIP_BATCHES, ActionKind.SCALE_LR, ActionKind.CLIP}
    for a in rest:
        ack = by_id[a.action_id]
        assert ack.status is AckStatus.FAILED, (a.kind, ack)
        assert f"the rollback {rollback.action_id} of the same decision was failed" in ack.result
    # Nothing of the plan took effect: no skip window, same LR, same clipping; training went on.
    assert guard.counters["rollbacks"] == 0 and guard.generation == 0 and guard.step_count == 70
    assert guard.counters["skipped_batches"] == 0 and guard.position.skip_ranges == []
    assert published(bus)[(0, 69)].lr == LR
    assert guard.clipper.settings() == clipping


def test_without_local_skips_the_outlier_model_still_scores_and_backs_a_real_spike(bus, tmp_path):
    tiny = Tiny(seed=14, lr=LR)
    guard = make_guard(tiny, bus, tmp_path, signing_key=KEY, skip_outliers=False)
    bad_step = 45
    poison = lambda step, epoch, y: y * 40.0 if (step, epoch) == (bad_step, 0) else y  # noqa: E731
    run(guard, tiny, bad_step + 1, poison)
    bad = published(bus)[(0, bad_step)]
    assert bad.skip_reason is None and guard.counters["outlier_skips"] == 0  # it did not skip...
    assert guard.actions.published.view(0, bad_step).loss_z >= AGREE_Z  # ... but it scored
    plan = signed_plan(bus, critical(bad_step, 0, AnomalyType.BAD_BATCH, evidence_of(bad)))
    send(bus, *plan, guard=guard)
    run(guard, tiny, 60, poison)
    guard.close()
    assert {a.status for a in acks(bus)} == {AckStatus.APPLIED}
    assert guard.counters["rollbacks"] == 1


def test_once_the_trainer_agreed_an_incident_was_real_its_later_actions_need_no_new_agreement(
    bus, tmp_path
):
    # A persistent incident (weights corrupted by bad data) keeps the pipeline's loss high while the
    # trainer's local model re-levels onto it: a later step of the same incident no longer looks
    # anomalous here. The policy's escalation (a stop after a failed recovery) is judged on such a
    # step; refusing it would leave a broken run training. An incident the trainer never agreed to
    # still needs its own agreement.
    from producers_helpers import action

    tiny = Tiny(seed=15, lr=LR)
    guard = make_guard(tiny, bus, tmp_path, signing_key=KEY)
    bad_step = 45
    poison = lambda step, epoch, y: y * 40.0 if (step, epoch) == (bad_step, 0) else y  # noqa: E731
    run(guard, tiny, 60, poison)
    steps = published(bus)

    def signed(kind, claimed: int, incident: str, **params):
        a = action(kind, 61, decision_id=f"d-{incident}-{claimed}-{kind.value}", **params)
        return sign_action(
            a.model_copy(
                update={
                    "incident_id": incident,
                    "evidence": evidence_of(steps[(0, claimed)]),
                    "claim": Claim(step=claimed, epoch=0, type=AnomalyType.LOSS_SPIKE),
                }
            ),
            KEY,
        )

    agreed = signed(ActionKind.SCALE_LR, bad_step, "inc-real", factor=0.5)
    stranger = signed(ActionKind.STOP, 59, "inc-other", reason="forged escalation")
    escalation = signed(ActionKind.STOP, 59, "inc-real", reason="needs recovery #2")
    send(bus, agreed, stranger, escalation, guard=guard)
    run(guard, tiny, 70, poison)
    guard.close()

    by_id = {a.action_id: a for a in acks(bus)}
    assert by_id[agreed.action_id].status is AckStatus.APPLIED
    assert by_id[stranger.action_id].status is AckStatus.REJECTED
    assert "the decision calls step 59" in by_id[stranger.action_id].result
    assert by_id[escalation.action_id].status is AckStatus.APPLIED, by_id[escalation.action_id]
    assert guard.should_stop and guard.step_count < 70
