"""The embedded pipeline in a child process (``worker.embedded_process``), bridged to the trainer's bus.

A real model trains through a persistent loss spike with the pipeline in a
child process: the rollback comes back over the bridge, is applied and acked;
forged steps still land in the DLQ (now the child's, bridged back); the
trainer's process runs no worker thread; closing the runtime stops the child.
"""

from __future__ import annotations

import math
import threading
import uuid

import pytest
import torch

from spikeguard.errors import ConfigError
from spikeguard.producers import Guard
from spikeguard.producers.config import GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.schemas import (
    Ack, AckStatus, Action, ActionKind, DeadLetter, Decision, StepEvent, decode, encode,
)
from spikeguard.schemas.signing import verify_action
from spikeguard.settings import load_settings

STEPS = 480
BAD_BATCHES = range(398, 406)


def settings(**extra):
    return load_settings({"topic_prefix": f"child-{uuid.uuid4().hex[:8]}.",
                          "worker": {"embedded_process": True}, **extra}, env={})


def problem():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 8, generator=generator)
    y = x @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(8192, 1, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)


def test_a_spike_is_rolled_back_by_the_pipeline_in_a_child_process(tmp_path):
    # (other tests' runtimes may have left daemon threads behind: only new ones count)
    before = {t.ident for t in threading.enumerate()}
    runtime = open_runtime(settings())
    try:
        assert runtime.workers == [] and runtime.threads == []  # no pipeline thread in this process
        assert not [t for t in threading.enumerate() if t.name == "spikeguard-ml" and t.ident not in before]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        config = GuardConfig(checkpoint_dir=str(tmp_path), lockstep=True, lockstep_timeout=30.0,
                             data_seed=0, resume=False, signing_key=runtime.settings.signing_key)
        guard = Guard(model, optimizer, run_id="child", config=config, bus=runtime.bus,
                      topics=runtime.topics)
        for x, y in guard.data(problem(), epochs=10, max_steps=STEPS):
            if guard.loader.last_index in BAD_BATCHES:
                y = y * 40.0 + 25.0
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            guard.step(loss)
        guard.close()
        bus, topics = runtime.bus, runtime.topics
        actions = [decode(r.value, Action) for r in bus.read_all(topics.actions)]
        acks = [decode(r.value, Ack) for r in bus.read_all(topics.acks)]
        decisions = [decode(r.value, Decision) for r in bus.read_all(topics.decisions)]
    finally:
        runtime.close()
    rollbacks = [a for a in actions if a.kind is ActionKind.ROLLBACK]
    assert rollbacks and all(verify_action(a, runtime.settings.signing_key) for a in actions)
    assert any(a.kind is ActionKind.ROLLBACK and a.status is AckStatus.APPLIED for a in acks)
    assert guard.epoch >= 1
    # Lockstep: every step was decided (in the child) and the decision came back here.
    assert {d.step for d in decisions if d.epoch == 0} >= set(range(0, BAD_BATCHES[0]))
    child = next(c.__self__ for c in runtime.closers if hasattr(c, "__self__"))
    assert child.process.returncode == 0


def test_forged_steps_still_land_in_the_dlq_across_the_bridge():
    runtime = open_runtime(settings())
    try:
        bus, topics = runtime.bus, runtime.topics
        producer = bus.producer()
        forged = [StepEvent(run_id="victim", step=s, time=1000.0 + s, loss=math.nan,
                            grad_norm=math.nan, lr=1e-3) for s in range(3)]
        for event in forged:  # the object itself too, as an in-process forger could hand it over
            producer.publish(topics.steps, encode(event), key=event.run_id, event=event)
        producer.flush()
        dead: list[DeadLetter] = []
        for _ in range(600):  # a bound on polling, not a timing assertion
            dead = [decode(r.value, DeadLetter) for r in bus.read_all(topics.dlq)]
            if len(dead) >= 3 * 4:
                break
            threading.Event().wait(0.1)
        refused = sorted((d.consumer.rsplit(".", 1)[1], decode(d.value, StepEvent).step) for d in dead)
        assert refused == sorted((name, s) for name in ("statistical", "rules", "ml", "predictor")
                                 for s in range(3))
        assert {d.error for d in dead} == {"StepNotAuthenticated"}
        assert bus.read_all(topics.actions) == []
    finally:
        runtime.close()


def test_the_child_process_and_data_dir_do_not_go_together(tmp_path):
    with pytest.raises(ConfigError, match="embedded_process"):
        open_runtime(settings(data_dir=str(tmp_path)))
