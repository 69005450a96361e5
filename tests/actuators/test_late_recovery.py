"""A recovery is judged only on steps after it took effect (issue 37, row 4b).

The finding: fusion replicas killed and restarted, a spike's decision came ~160 steps late,
and in the same instant the policy sent STOP ("needs recovery #2"): it counted the anomalous
steps the trainer ran *before* recovery #1 existed as that recovery's failure. Here the late
burst of decisions arrives before any ack: nothing is stopped. Once the trainer acks the
recovery, the steps after it do judge it, and a recovery that really failed still stops the run.
"""

from __future__ import annotations

from spikeguard.actuators import PolicyConfig, RecoveryPolicy
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind as K,
    AnomalyType as T,
    CheckpointEvent,
    Decision,
    decision_id,
    incident_id,
)

R = "late-run"

CONFIG = {"non_finite_skipped_by_trainer": False}  # a critical decision recovers at once
ONSET, BACKLOG = 500, 160  # the trainer is BACKLOG steps past the decision when it comes


def dec(step: int, kind: T | None = None, onset: int | None = None) -> Decision:
    if kind is None:
        return Decision(decision_id=decision_id(R, step), run_id=R, step=step, is_anomaly=False)
    onset = step if onset is None else onset
    return Decision(
        decision_id=decision_id(R, step),
        run_id=R,
        step=step,
        is_anomaly=True,
        type=kind,
        confidence=0.9,
        critical=True,
        incident_id=incident_id(R, onset),
        incident_onset_step=onset,
    )


def ack(action: Action, step: int) -> Ack:
    return Ack(
        run_id=R, action_id=action.action_id, kind=action.kind, status=AckStatus.APPLIED, step=step
    )


def kinds(actions: list[Action]) -> list[K]:
    return [a.kind for a in actions]


def healthy(policy: RecoveryPolicy, start: int, end: int) -> None:
    for step in range(start, end):
        policy.on_decision(dec(step))


def _policy(*checkpoints: int) -> RecoveryPolicy:
    policy = RecoveryPolicy(PolicyConfig(**CONFIG), run_id=R)
    for step in checkpoints:
        policy.on_checkpoint(
            CheckpointEvent(run_id=R, step=step, checkpoint_id=f"ck-{step}", healthy=True)
        )
    healthy(policy, 301, ONSET)
    return policy


def _burst(policy: RecoveryPolicy, start: int, end: int) -> list:
    """The late decisions of steps the trainer already ran, all at once (no ack in between)."""
    out = []
    for step in range(start, end):
        out += policy.on_decision(dec(step, T.NON_FINITE, onset=ONSET))
    return out


def test_a_late_fallback_is_not_failed_by_the_steps_run_before_it_existed():
    policy = _policy()  # no checkpoint: recovery #1 is the fallback (LR down, skip ahead)
    first = policy.on_decision(dec(ONSET, T.NON_FINITE))
    assert K.SKIP_BATCHES in kinds(first) and K.ROLLBACK not in kinds(first)
    assert K.STOP not in kinds(_burst(policy, ONSET + 1, ONSET + BACKLOG))
    assert not policy.stopped
    # The trainer applies the plan where it is now; what it runs after that judges the recovery.
    applied_at = ONSET + BACKLOG
    policy.on_ack(ack(first[0], step=applied_at))
    after = policy.on_decision(dec(applied_at + 5, T.NON_FINITE, onset=ONSET))
    assert kinds(after) == [K.CHECKPOINT, K.STOP, K.ALERT]
    assert "needs recovery #2" in after[1].params["reason"]


def test_a_late_rollback_unacknowledged_past_its_timeout_is_not_failed_either():
    policy = _policy(100, 200, 300)
    first = policy.on_decision(dec(ONSET, T.NON_FINITE))
    assert kinds(first)[0] is K.ROLLBACK
    burst = _burst(policy, ONSET + 1, ONSET + BACKLOG)  # past rollback_ack_timeout_steps (100)
    assert K.STOP not in kinds(burst) and not policy.stopped
    policy.on_ack(ack(first[0], step=ONSET + BACKLOG))
    healthy(policy, 401, ONSET)  # the re-run, in the new epoch
    assert not policy.stopped
