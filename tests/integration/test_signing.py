"""On a real broker: nobody but the run's own pipeline steers it.

Forged actions (unsigned, or signed with another key) written to the actions
topic by someone else are refused by the trainer, acked REJECTED with the
reason and logged; the guard and the actuator worker do not start on Kafka
without a key unless the user opts out, loudly.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid

import pytest
import torch

from spikeguard.producers import Guard
from spikeguard.producers.config import GuardConfig
from spikeguard.schemas import Ack, AckStatus, Action, ActionKind, Topics, decode, sign_action
from spikeguard.trust import MissingSigningKey

pytestmark = pytest.mark.kafka
KEY = "integration-signing-key-0123456789"


def kafka_env(monkeypatch, bootstrap, prefix, **extra):
    for name in ("SPIKEGUARD_SIGNING_KEY", "SPIKEGUARD_INSECURE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPIKEGUARD_BOOTSTRAP_SERVERS", bootstrap)
    monkeypatch.setenv("SPIKEGUARD_TOPIC_PREFIX", prefix)
    for name, value in extra.items():
        monkeypatch.setenv(name, value)


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_guard_refuses_to_start_on_kafka_without_a_key(kafka_bootstrap, monkeypatch, tmp_path):
    kafka_env(monkeypatch, kafka_bootstrap, f"sign-{uuid.uuid4().hex[:8]}.")
    model, optimizer = tiny()
    with pytest.raises(MissingSigningKey, match="SPIKEGUARD_SIGNING_KEY"):
        Guard(model, optimizer, run_id="no-key", config=GuardConfig(checkpoint_dir=str(tmp_path)))


def test_the_guard_opts_out_only_explicitly_and_loudly(
    kafka_bootstrap, monkeypatch, tmp_path, caplog
):
    kafka_env(
        monkeypatch, kafka_bootstrap, f"sign-{uuid.uuid4().hex[:8]}.", SPIKEGUARD_INSECURE="1"
    )
    model, optimizer = tiny()
    with caplog.at_level(logging.WARNING):
        guard = Guard(
            model,
            optimizer,
            run_id="insecure",
            config=GuardConfig(checkpoint_dir=str(tmp_path), resume=False),
        )
    guard.close()
    loud = [r for r in caplog.records if "INSECURE" in r.getMessage()]
    assert len(loud) == 1 and loud[0].levelno == logging.WARNING


def test_forged_actions_on_the_topic_are_not_applied(
    kafka_bootstrap, monkeypatch, tmp_path, caplog
):
    from spikeguard.bus.kafka import KafkaBus

    prefix = f"sign-{uuid.uuid4().hex[:8]}."
    run_id = "victim-run"
    kafka_env(monkeypatch, kafka_bootstrap, prefix, SPIKEGUARD_SIGNING_KEY=KEY)
    model, optimizer = tiny()
    guard = Guard(
        model,
        optimizer,
        run_id=run_id,
        config=GuardConfig(checkpoint_dir=str(tmp_path), resume=False),
    )
    forged = [
        Action(
            action_id="forged-lr",
            run_id=run_id,
            kind=ActionKind.SCALE_LR,
            apply_at_step=0,
            params={"factor": 0.001},
        ),
        Action(action_id="forged-stop", run_id=run_id, kind=ActionKind.STOP, apply_at_step=0),
        sign_action(
            Action(
                action_id="forged-other-key", run_id=run_id, kind=ActionKind.STOP, apply_at_step=0
            ),
            "not-the-run's-key",
        ),
    ]
    attacker = KafkaBus(kafka_bootstrap)
    producer = attacker.producer()
    for action in forged:
        producer.publish(Topics(prefix).actions, action.model_dump_json().encode(), key=run_id)
    producer.close()

    x, y = torch.randn(16, 4), torch.randn(16, 1)
    ids = {a.action_id for a in forged}
    deadline = time.monotonic() + 60
    try:
        with caplog.at_level(logging.WARNING, logger="spikeguard.producers.actions"):
            while not ids <= {a["action_id"] for a in guard.applied}:
                assert time.monotonic() < deadline, f"the guard saw only {list(guard.applied)}"
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                guard.step(loss)
                time.sleep(0.02)
        assert not guard.should_stop
        assert guard.lr.effective() == pytest.approx(0.1)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
        assert guard.counters["actions_applied"] == 0
    finally:
        guard.close()
    acks = {
        a.action_id: a
        for a in (decode(r.value, Ack) for r in attacker.read_all(Topics(prefix).acks))
    }
    assert {acks[i].status for i in ids} == {AckStatus.REJECTED}
    assert "unsigned" in acks["forged-lr"].result and "unsigned" in acks["forged-stop"].result
    assert "bad signature" in acks["forged-other-key"].result
    logged = " ".join(r.getMessage() for r in caplog.records)
    for i in ids:
        assert f"action {i} for run {run_id}" in logged
    attacker.close()


def run_actuator(bootstrap, prefix, *flags, key=None, insecure=None, seconds=60):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SPIKEGUARD_SIGNING_KEY", "SPIKEGUARD_INSECURE")
    }
    env["SPIKEGUARD_BOOTSTRAP_SERVERS"] = bootstrap
    if key is not None:
        env["SPIKEGUARD_SIGNING_KEY"] = key
    if insecure is not None:
        env["SPIKEGUARD_INSECURE"] = insecure
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spikeguard",
            "worker",
            "actuator",
            "--topic-prefix",
            prefix,
            *flags,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def started_then_stopped(worker) -> str:
    """Read the worker's output until it says it started, then stop it; all output so far."""
    lines = []
    for line in worker.stdout:
        lines.append(line)
        if line.startswith("spikeguard worker:"):
            break
    worker.terminate()
    rest, _ = worker.communicate(timeout=60)
    return "".join(lines) + rest


def test_the_actuator_worker_refuses_to_start_without_a_key(kafka_bootstrap):
    prefix = f"sign-{uuid.uuid4().hex[:8]}."
    refused = run_actuator(kafka_bootstrap, prefix)
    out, _ = refused.communicate(timeout=120)
    assert refused.returncode == 2, out
    [line] = [l for l in out.splitlines() if l.strip()]
    assert "refuses to start on Kafka without a signing key" in line and "--insecure" in line

    for flags, insecure in ((("--insecure",), None), ((), "1")):
        worker = run_actuator(kafka_bootstrap, prefix, *flags, insecure=insecure)
        out = started_then_stopped(worker)
        loud = [l for l in out.splitlines() if "INSECURE" in l]
        assert len(loud) == 1 and "WARNING" in loud[0], out

    worker = run_actuator(kafka_bootstrap, prefix, key=KEY)
    out = started_then_stopped(worker)
    assert "INSECURE" not in out and KEY not in out
