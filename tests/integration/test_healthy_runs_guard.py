"""The live Guard, with its defaults, leaves healthy runs alone.

Real torch trainings from the healthy-run suite (spikeguard.lab.healthy_runs),
nothing injected, under the default Guard and the embedded pipeline: on a
healthy run every action is a false one. Each must complete with no stop, no
rollback, no skipped batch, the LR it would have had without the guard, and
at most 0.5 % of its updates skipped by the Guard's local rule. Lockstep only
makes the step at which an action lands reproducible; the decisions are the
same without it.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
import torch
from prometheus_client import CollectorRegistry

from spikeguard.lab.healthy_runs import KINDS
from spikeguard.metrics import Metrics
from spikeguard.producers import Guard
from spikeguard.producers.config import GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.schemas import Action, ActionKind, decode
from spikeguard.settings import load_settings

SEED = 0
#: The kinds a user meets first and the defaults got wrong: stationary batch-1 noise, a
#: heavy-tailed classification loss (label noise) at batch 4, and a loss that goes below zero
#: (a Gaussian NLL). Steps: enough for the detectors' windows to fill many times over, short
#: enough for CI; the Gaussian NLL's, past step 3889, where its log-space judging cut the LR.
CASES = {"regression_b1": 1500, "classification_noisy_b4": 1500, "gaussian_nll": 4200}
MAX_LOCAL_SKIP_SHARE = 0.005


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_the_default_guard_leaves_a_healthy_run_alone(tmp_path, kind):
    steps = CASES[kind]
    settings = load_settings({"topic_prefix": f"healthy-{uuid.uuid4().hex[:8]}."}, env={})
    task = KINDS[kind].build(SEED, steps)
    start_lr = [group["lr"] for group in task.optimizer.param_groups]
    with open_runtime(settings, metrics=Metrics(CollectorRegistry())) as runtime:
        config = GuardConfig(
            checkpoint_dir=str(tmp_path),
            lockstep=True,
            data_seed=SEED,
            resume=False,
        )
        guard = Guard(
            task.model,
            task.optimizer,
            task.scheduler,
            run_id=f"healthy-{kind}",
            config=config,
            runtime=runtime,
        )
        try:
            for batch in guard.data(task.loader, epochs=steps, max_steps=steps):
                task.optimizer.zero_grad(set_to_none=True)
                loss = task.loss(batch)
                loss.backward()
                guard.step(loss)
        finally:
            guard.close()
        actions = [decode(r.value, Action) for r in runtime.bus.read_all(runtime.topics.actions)]
    counters = guard.counters
    taken = Counter(a.kind.value for a in actions if a.kind is not ActionKind.ALERT)
    seen = (
        f"{kind}: {guard.step_count} of {steps} steps, stop={guard.stop_reason!r}, "
        f"counters={counters}, actions={dict(taken)}"
    )
    assert not guard.should_stop and guard.step_count == steps, seen
    assert counters["rollbacks"] == 0 and taken[ActionKind.ROLLBACK.value] == 0, seen
    assert counters["skipped_batches"] == 0 and taken[ActionKind.SKIP_BATCHES.value] == 0, seen
    assert not {ActionKind.SCALE_LR.value, ActionKind.SET_LR.value} & set(taken), seen
    assert [group["lr"] for group in task.optimizer.param_groups] == start_lr, (
        seen
    )  # no scheduler here
    assert counters["outlier_skips"] <= MAX_LOCAL_SKIP_SHARE * steps, seen
