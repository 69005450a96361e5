"""Lockstep gives one result per seed however slowly the pipeline answers.

The actions a recovery ends with (the LR given back, the clipping lifted) are decided on healthy
steps, long after the anomaly. A lockstep trainer that waited only briefly for actions after an
anomalous decision applied those whenever they happened to arrive: "lift_clip at step 109: late
(due at step 108)" on a loaded machine, and so a different run. Here the actuator is made slow
whenever it has something to say, and the run must be the same run, action for action and
weight for weight, as with a quick one.
"""

from __future__ import annotations

import re
import time
import uuid

import pytest
import torch
from producers_helpers import lockstep_regression_guard, noisy_regression

from spikeguard.actuators.actuator_stage import ActuatorStage
from spikeguard.runtime import open_runtime
from spikeguard.schemas import ActionKind
from spikeguard.settings import load_settings

pytestmark = pytest.mark.heavy

STEPS = 90
FAULT = set(range(60, 66))  # garbage targets: a rollback, skipped batches, an LR cut and a clip
POLICY = {"rollback_min_steps_before_onset": 20, "lr_restore_healthy_steps": 10}
SLOW_S = 0.25  # well over the settle time lockstep gives an anomalous decision's actions


def _train(tmp_path, spiked_step, name: str):
    """The guarded run on a runtime of threads: its applied actions and its final weights."""
    settings = load_settings(
        {"topic_prefix": f"{name}-{uuid.uuid4().hex[:8]}.", "worker.embedded_process": False},
        env={},
    )
    with open_runtime(settings) as runtime:
        guard, model, optimizer = lockstep_regression_guard(runtime, tmp_path, name, POLICY)
        for x, y in guard.data(noisy_regression(), epochs=10, max_steps=STEPS):
            spiked_step(guard, model, optimizer, x, y, FAULT)
        guard.close()
    applied = [  # a checkpoint's id is the session's: the same run names it differently
        (a["kind"], a["step"], a["status"], re.sub(r"c-[0-9a-f]+", "c-<id>", a["result"]))
        for a in guard.acks.applied
        if a["kind"] != ActionKind.PULSE.value
    ]
    return applied, [p.detach().clone() for p in model.parameters()]


def test_a_slow_actuator_changes_nothing_in_a_lockstep_run(tmp_path, spiked_step, monkeypatch):
    quick, quick_weights = _train(tmp_path, spiked_step, "lockstep-quick")
    kinds = {kind for kind, *_ in quick}
    # The run has the actions decided long after its anomaly, the ones a slow actuator delayed.
    assert {"rollback", "scale_lr", "clip", "restore_lr"} <= kinds, quick
    assert any("lifted" in result for kind, _, _, result in quick if kind == "clip"), quick
    assert not any("late" in result for *_, result in quick), quick

    handle = ActuatorStage.handle_batch

    def slow(self, items):
        out = handle(self, items)
        if any(getattr(a, "kind", None) is not ActionKind.PULSE for _, a in out):
            time.sleep(SLOW_S)  # not a wait: a loaded machine, the actions come late
        return out

    monkeypatch.setattr(ActuatorStage, "handle_batch", slow)
    slowed, slowed_weights = _train(tmp_path, spiked_step, "lockstep-slow")
    assert slowed == quick
    assert all(torch.equal(a, b) for a, b in zip(slowed_weights, quick_weights))
