"""An alert is raised only for what is really unacknowledged (issue 37, row 8).

The finding: an actuator killed and restarted raised "not acknowledged" alerts for a rollback
the trainer had acked, and a restore_lr issued after the restart was never applied. After a
restart the actuator reads a backlog, and nothing orders the decisions topic against the acks
topic: the re-run's decisions (the rollback's new epoch) can all come before the rollback's
ack. Here the real actuator stage, restarted from its snapshot (a JSON round trip) right after
it issued a rollback, gets the run's next 300 decisions before the ack: it says nothing about an
unacknowledged rollback, and issues exactly the actions it issues when the ack comes first.
"""

from __future__ import annotations

import json

from spikeguard.actuators import PolicyConfig, RecoveryPolicy
from spikeguard.actuators.actuator_stage import ActuatorStage
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    AnomalyType,
    CheckpointEvent,
    Decision,
    Topics,
    incident_id,
)

R = "backlog-run"
TOPICS = Topics()
CONFIG = PolicyConfig(non_finite_skipped_by_trainer=False)  # a critical step rolls back at once


def _stage() -> ActuatorStage:
    return ActuatorStage(
        TOPICS, lambda run_id, config=None: RecoveryPolicy(config or CONFIG, run_id=run_id)
    )


def _restarted(stage: ActuatorStage) -> ActuatorStage:
    fresh = _stage()
    fresh.restore(json.loads(json.dumps(stage.snapshot([R]))))
    return fresh


def _decision(step: int, epoch: int = 0, anomalous: bool = False) -> tuple[str, Decision]:
    extra = (
        dict(
            type=AnomalyType.NON_FINITE,
            confidence=0.9,
            critical=True,
            incident_id=incident_id(R, step),
            incident_onset_step=step,
        )
        if anomalous
        else {}
    )
    return TOPICS.decisions, Decision(
        decision_id=f"d-{epoch}-{step}",
        run_id=R,
        step=step,
        epoch=epoch,
        is_anomaly=anomalous,
        **extra,
    )


def _ack(action: Action) -> tuple[str, Ack]:
    return TOPICS.acks, Ack(
        run_id=R,
        action_id=action.action_id,
        kind=action.kind,
        status=AckStatus.APPLIED,
        step=action.apply_at_step,
    )


def _run(ack_first: bool) -> list[tuple[str, int, str]]:
    """The actions after the rollback: (kind, apply_at_step, message or params)."""
    stage = _stage()
    items: list = [
        (TOPICS.checkpoints, CheckpointEvent(run_id=R, step=s, checkpoint_id=f"c{s}", healthy=True))
        for s in (100, 200, 300, 400)
    ]
    items += [_decision(s) for s in range(401, 500)] + [_decision(500, anomalous=True)]
    rollback = next(a for _, a in stage.handle_batch(items) if a.kind is ActionKind.ROLLBACK)
    stage = _restarted(stage)  # killed right after the rollback went out
    rerun = [_decision(s, epoch=1) for s in range(401, 700)]
    batches = [[_ack(rollback)], rerun] if ack_first else [rerun, [_ack(rollback)]]
    out = [a for batch in batches for _, a in stage.handle_batch(batch)]
    return [
        (a.kind.value, a.apply_at_step, str(a.params.get("message") or dict(a.params)))
        for a in out
        if a.kind is not ActionKind.PULSE
    ]


def test_a_backlog_of_the_new_epoch_before_the_ack_changes_nothing():
    in_order = _run(ack_first=True)
    assert any(kind == "restore_lr" for kind, _, _ in in_order), in_order
    late_ack = _run(ack_first=False)
    assert not any("not acknowledged" in text for _, _, text in late_ack), late_ack
    assert late_ack == in_order
