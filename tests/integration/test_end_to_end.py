"""The whole loop with a real torch model: spike -> decision -> action -> applied -> ack.

The same test runs on the embedded bus (all components as threads of this
process) and on a real Kafka broker (all components in a separate
``spikeguard worker all`` process, as in production).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

from spikeguard.producers import Guard
from spikeguard.producers.config import GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.components import DETECTOR_NAMES
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    Decision,
    StepVerdicts,
    Topics,
    Verdict,
    decode,
)
from spikeguard.settings import load_settings

# The rollback lands at step 154 and goes back to step 40; the re-run passes the bad batches
# (skipped) by step 158. What is checked is settled by then: the run stops 22 steps later.
STEPS = 180
BAD_BATCHES = range(150, 158)  # global batch indices whose labels are garbage


def make_problem(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(4096, 8, generator=generator)
    w = torch.randn(8, 1, generator=generator)
    y = x @ w + 0.1 * torch.randn(4096, 1, generator=generator)
    dataset = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True)


def train(tmp_path, run_id, *, runtime=None, bus=None, topics=None, signing_key=None):
    """A guarded run with corrupted batches: on a runtime (its key), or on a bus with ``signing_key``."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = GuardConfig(
        checkpoint_dir=str(tmp_path / run_id),
        checkpoint_every=20,
        keep_checkpoints=8,
        lockstep=True,
        lockstep_timeout=30.0,
        data_seed=0,
        signing_key=signing_key,
    )
    guard = Guard(
        model, optimizer, run_id=run_id, config=config, runtime=runtime, bus=bus, topics=topics
    )
    corrupted = 0
    for x, y in guard.data(make_problem(), epochs=10, max_steps=STEPS):
        if guard.loader.last_index in BAD_BATCHES:
            y = y * 40.0 + 25.0  # a corrupted batch: a real, persistent loss spike
            corrupted += 1
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.step(loss)
    guard.close()
    return guard, corrupted


def read(bus, topic, model, run_id):
    events = [decode(r.value, model) for r in bus.read_all(topic)]
    return [e for e in events if e.run_id == run_id]


def wait_for_the_applied_acks(bus, topics, run_id, wait_until):
    """Until the rollback's and the LR change's acks, which the guard sends last, can be read back."""

    def applied():
        return {
            a.kind for a in read(bus, topics.acks, Ack, run_id) if a.status is AckStatus.APPLIED
        }

    wait_until(
        lambda: {ActionKind.ROLLBACK, ActionKind.SCALE_LR} <= applied(),
        f"the applied rollback and LR acks of {run_id} on the bus",
    )


def check_the_loop_closed(bus, topics, guard, corrupted, run_id):
    decisions = read(bus, topics.decisions, Decision, run_id)
    onset = BAD_BATCHES[0]  # one batch per step, no rollback before it: batch index == step
    at_onset = [d for d in decisions if d.step == onset and d.epoch == 0]
    assert at_onset and at_onset[0].is_anomaly, "the spike's first step got no anomalous decision"
    actions = read(bus, topics.actions, Action, run_id)
    kinds = {a.kind for a in actions}
    assert ActionKind.ROLLBACK in kinds and ActionKind.SCALE_LR in kinds, kinds
    acks = read(bus, topics.acks, Ack, run_id)
    applied = {a.kind for a in acks if a.status is AckStatus.APPLIED}
    assert {ActionKind.ROLLBACK, ActionKind.SCALE_LR} <= applied, acks
    assert guard.generation >= 1  # the trainer really rolled back
    # The skip window kept the bad batches out of the re-run: fewer corrupted steps
    # than the window holds would be seen twice.
    assert corrupted < 2 * len(BAD_BATCHES)
    # The LR the recovery cut comes back once the re-run has trained past the skipped batches
    # with no anomaly (the cause is gone); whether that restore came before the run's last step
    # depends on the layout's timing. Either way the trainer's LR is what its acks say.
    if ActionKind.RESTORE_LR in applied:
        restores = [a for a in actions if a.kind is ActionKind.RESTORE_LR]
        assert any("cause_removed" in a.reason for a in restores), [a.reason for a in restores]
        assert guard.lr.effective() == pytest.approx(0.05)
        # ... and the clipping the recovery set is lifted in the same plan
        lifts = [a for a in actions if a.kind is ActionKind.CLIP and a.params.lifts]
        assert lifts and guard.clipper.threshold() is None, guard.clipper.settings()
    else:
        assert guard.lr.effective() < 0.05  # the guard scales the LR around optimizer.step()


def test_embedded_loop(tmp_path):
    prefix = f"e2e-{uuid.uuid4().hex[:8]}."
    settings = load_settings({"topic_prefix": prefix}, env={})
    with open_runtime(settings) as runtime:
        # The runtime made this process's key; the trainer obeys only what it signs.
        guard, corrupted = train(tmp_path, "embedded-run", runtime=runtime)
        check_the_loop_closed(runtime.bus, runtime.topics, guard, corrupted, "embedded-run")


@pytest.mark.kafka
@pytest.mark.parametrize(
    "layout",
    [
        ("all",),  # every component as a thread of one `spikeguard worker all` process
        ("detectors", "fusion", "actuator"),  # the four detectors co-hosted behind one consumer
    ],
    ids=["worker-all", "cohosted-detectors"],
)
@pytest.mark.parametrize("client", ["kafka-python", "confluent"])  # settings.kafka_client
def test_kafka_loop(tmp_path, kafka_bootstrap, layout, client, wait_until):
    from spikeguard.bus.confluent import ConfluentBus
    from spikeguard.bus.kafka import KafkaBus

    prefix = f"e2e-{uuid.uuid4().hex[:8]}."
    key = "e2e-signing-key-" + uuid.uuid4().hex
    env = {
        **os.environ,
        "SPIKEGUARD_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "SPIKEGUARD_SIGNING_KEY": key,
        "SPIKEGUARD_KAFKA_CLIENT": client,
    }
    logs = [tmp_path / f"worker-{name}.log" for name in layout]
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "spikeguard", "worker", name, "--topic-prefix", prefix],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, log in zip(layout, logs)
    ]
    try:
        deadline = time.monotonic() + 60
        for worker, log in zip(workers, logs):
            while "spikeguard worker:" not in log.read_text():
                assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            assert f"on kafka via {client} " in log.read_text()  # the workers speak Kafka with it
        bus = (ConfluentBus if client == "confluent" else KafkaBus)(
            kafka_bootstrap
        )  # the trainer too
        topics = Topics(prefix)
        guard, corrupted = train(tmp_path, "kafka-run", bus=bus, topics=topics, signing_key=key)
        wait_for_the_applied_acks(bus, topics, "kafka-run", wait_until)
        check_the_loop_closed(bus, topics, guard, corrupted, "kafka-run")
        if "detectors" in layout:  # the co-hosted detectors sent each step's verdicts as one record
            packed = read(bus, topics.step_verdicts, StepVerdicts, "kafka-run")
            assert packed and all(
                {v.detector for v in p.verdicts} == set(DETECTOR_NAMES) for p in packed
            )
            assert not read(bus, topics.verdicts, Verdict, "kafka-run")
        bus.close()
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
    for worker, log in zip(workers, logs):
        assert worker.returncode == 0, log.read_text()
