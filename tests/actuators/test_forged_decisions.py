"""Forged decisions cannot steer a run, on the real closed loop.

Anyone who can write the decisions topic would make the real actuator sign
actions if it answered whatever decision it read. With a signing key, fusion
signs its decisions and the actuator takes no others: a forged one goes to the
DLQ with the reason and no action is derived from it. (Behind that, the trainer
still checks every action's evidence against what it published:
tests/producers/test_action_evidence.py.) A real model trains on the embedded
runtime through a real loss spike while forged critical decisions for its run
arrive on the decisions topic: no evidence, evidence the trainer never
published, and one that asks for a rollback with a real checkpoint as target.
"""

from __future__ import annotations

import math
import uuid

import pytest
import torch
from prometheus_client import CollectorRegistry

from spikeguard.metrics import Metrics
from spikeguard.producers import Guard
from spikeguard.producers.config import GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    AnomalyType,
    DeadLetter,
    Decision,
    Evidence,
    StepEvent,
    decode,
    encode,
)
from spikeguard.settings import load_settings

STEPS = 260
BAD_BATCHES = range(150, 158)  # global batch indices whose labels are garbage: a real spike
FORGE_AT = (40, 70, 100, 125)  # trainer steps at which a forged decision is written
RUN = "victim"


def forged(step: int, published: dict[int, StepEvent]) -> Decision:
    """A critical non-finite decision for ``step``; its evidence absent, or not what was published."""
    evidence = None
    if step == 100:  # names a step the trainer did publish, with a loss it never had
        real = published[step - 1]
        evidence = Evidence(
            step=real.step, epoch=real.epoch, loss=math.nan, grad_norm=real.grad_norm
        )
    return Decision(
        decision_id=f"forged-{step}",
        run_id=RUN,
        step=step,
        is_anomaly=True,
        critical=True,
        type=AnomalyType.NON_FINITE,
        confidence=1.0,
        incident_id=f"forged-incident-{step}",
        incident_onset_step=step,
        evidence=evidence,
    )


@pytest.mark.parametrize("child", [False, True], ids=["threads", "child-process"])
def test_forged_decisions_get_no_action_applied_and_the_real_loop_still_rolls_back(
    tmp_path, regression_loader, spiked_step, child
):
    # Threads: the actuator reads the trainer's bus and refuses the forgeries. Child process (the
    # default): the trainer's bus carries decisions only up from the pipeline, so a decision
    # written on it reaches no actuator at all.
    settings = load_settings(
        {"topic_prefix": f"forged-{uuid.uuid4().hex[:8]}.", "worker": {"embedded_process": child}},
        env={},
    )
    # Its own metrics registry: the process-wide one would keep this run's series for later tests.
    with open_runtime(settings, metrics=Metrics(CollectorRegistry())) as runtime:
        bus, topics = runtime.bus, runtime.topics
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        config = GuardConfig(
            checkpoint_dir=str(tmp_path),
            checkpoint_every=20,
            keep_checkpoints=8,
            lockstep=True,
            lockstep_timeout=30.0,
            data_seed=0,
            resume=False,
        )
        guard = Guard(model, optimizer, run_id=RUN, config=config, runtime=runtime)
        forger = bus.producer()
        for x, y in guard.data(regression_loader(4096), epochs=10, max_steps=STEPS):
            if guard.generation == 0 and guard.step_count in FORGE_AT:
                published = {
                    e.step: e
                    for e in (decode(r.value, StepEvent) for r in bus.read_all(topics.steps))
                    if e.run_id == RUN
                }
                forger.publish(
                    topics.decisions, encode(forged(guard.step_count, published)), key=RUN
                )
            spiked_step(guard, model, optimizer, x, y, BAD_BATCHES)
        guard.close()
        actions = [
            a
            for a in (decode(r.value, Action) for r in bus.read_all(topics.actions))
            if a.run_id == RUN
        ]
        acks = {
            a.action_id: a
            for a in (decode(r.value, Ack) for r in bus.read_all(topics.acks))
            if a.run_id == RUN
        }
        letters = [decode(r.value, DeadLetter) for r in bus.read_all(topics.dlq)]

    # The actuator signed no action for any forged decision: each went to the DLQ, with the reason.
    assert not [a for a in actions if (a.decision_id or "").startswith("forged-")]
    refused = [d for d in letters if d.source_topic == topics.decisions]
    if child:
        assert refused == []
    else:
        assert sorted(decode(d.value, Decision).step for d in refused) == list(FORGE_AT)
        assert {d.error for d in refused} == {"RecordNotAuthenticated"}
        assert all("no signature" in d.reason for d in refused)
    # The real incident is still answered: a rollback to a checkpoint before it, applied.
    real = [a for a in actions if a.kind is ActionKind.ROLLBACK]
    assert real and any(
        acks[a.action_id].status is AckStatus.APPLIED for a in real if a.action_id in acks
    )
    assert guard.generation >= 1 and not guard.should_stop and guard.step_count == STEPS
    assert guard.counters["rollbacks"] == 1


def test_a_rollback_the_trainer_refused_neither_counts_against_the_window_nor_loses_its_checkpoint():
    """Refused rollbacks (a forged decision's) must not bring the run nearer a stop, nor cost it a target."""
    from spikeguard.actuators import PolicyConfig, RecoveryPolicy
    from spikeguard.schemas import CheckpointEvent

    policy = RecoveryPolicy(
        PolicyConfig(
            max_rollbacks_in_window=1,
            rollback_window_steps=10_000,
            non_finite_skipped_by_trainer=False,
        ),
        run_id=RUN,
    )
    policy.on_checkpoint(CheckpointEvent(run_id=RUN, step=0, checkpoint_id="c0", healthy=True))

    def critical(step: int) -> list[Action]:
        return policy.on_decision(
            Decision(
                decision_id=f"d{step}",
                run_id=RUN,
                step=step,
                is_anomaly=True,
                critical=True,
                type=AnomalyType.NON_FINITE,
                confidence=1.0,
                incident_id=f"i{step}",
                incident_onset_step=step,
            )
        )

    first = next(a for a in critical(150) if a.kind is ActionKind.ROLLBACK)
    policy.on_ack(
        Ack(
            run_id=RUN,
            action_id=first.action_id,
            kind=ActionKind.ROLLBACK,
            status=AckStatus.REJECTED,
            step=151,
            result="carries no evidence; action refused",
        )
    )
    second = critical(300)
    assert [a.params.checkpoint_id for a in second if a.kind is ActionKind.ROLLBACK] == ["c0"]
    assert ActionKind.STOP not in {a.kind for a in second}
