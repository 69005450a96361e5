"""With every default (trainer and pipeline), a rollback finds its target.

Checkpoint every 50, keep 3 and roll back at least 100 steps before the onset
used to leave no target: runs logged "no healthy checkpoint at least 100 steps
before onset" and fell back to lowering the LR. A real model trains through a
persistent loss spike with GuardConfig's and the pipeline's defaults; the
answer is a rollback, never that fallback.
"""

from __future__ import annotations

import uuid

import torch
from prometheus_client import CollectorRegistry

from spikeguard.metrics import Metrics
from spikeguard.producers import Guard
from spikeguard.producers.config import GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.schemas import Ack, AckStatus, Action, ActionKind, decode
from spikeguard.settings import load_settings

STEPS = 480
BAD_BATCHES = range(398, 406)  # just before a checkpoint (400): the old cadence kept none 100 back


def test_defaults_roll_back_to_a_checkpoint_far_enough_before_the_onset(
    tmp_path, regression_loader, spiked_step
):
    settings = load_settings({"topic_prefix": f"defaults-{uuid.uuid4().hex[:8]}."}, env={})
    # Its own metrics registry: the process-wide one would keep this run's series for later tests.
    with open_runtime(settings, metrics=Metrics(CollectorRegistry())) as runtime:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        # Defaults but for where checkpoints go, lockstep (one seed, one result) and the key.
        config = GuardConfig(
            checkpoint_dir=str(tmp_path),
            lockstep=True,
            lockstep_timeout=30.0,
            data_seed=0,
            resume=False,
        )
        guard = Guard(
            model,
            optimizer,
            run_id="defaults",
            config=config,
            runtime=runtime,
        )
        for x, y in guard.data(regression_loader(), epochs=10, max_steps=STEPS):
            spiked_step(guard, model, optimizer, x, y, BAD_BATCHES)
        guard.close()
        actions = [decode(r.value, Action) for r in runtime.bus.read_all(runtime.topics.actions)]
        acks = [decode(r.value, Ack) for r in runtime.bus.read_all(runtime.topics.acks)]
    reasons = [a.reason for a in actions] + [str(a.params) for a in actions]
    assert not any("no healthy checkpoint" in r for r in reasons), reasons
    rollbacks = [a for a in actions if a.kind is ActionKind.ROLLBACK]
    assert rollbacks and rollbacks[0].params.target_step <= BAD_BATCHES[0] - 100
    assert any(a.kind is ActionKind.ROLLBACK and a.status is AckStatus.APPLIED for a in acks)
    assert guard.generation >= 1
    assert (guard.config.checkpoint_every, guard.config.keep_checkpoints) == (50, 4)  # the defaults
