"""An operator's stop reaches a keyed trainer on a real broker (the documented path).

With a signing key the Guard refuses state-changing actions that name no step
it published; ``spikeguard stop RUN_ID`` signs its STOP with the key and
copies the evidence of the run's newest step from the steps topic, so the
trainer obeys it. A bare signed STOP (no evidence) sent next to it is refused.
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
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    Topics,
    decode,
    encode,
    sign_action,
)

pytestmark = pytest.mark.kafka
KEY = "operator-stop-key-0123456789"


def test_spikeguard_stop_stops_a_keyed_trainer_and_a_bare_signed_stop_does_not(
    kafka_bootstrap, tmp_path
):
    from spikeguard.bus.kafka import KafkaBus

    prefix = f"stop-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    bus = KafkaBus(kafka_bootstrap)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = Guard(
        model,
        optimizer,
        run_id="op-run",
        bus=bus,
        topics=topics,
        config=GuardConfig(checkpoint_dir=str(tmp_path), resume=False, signing_key=KEY),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}
    env.update(SPIKEGUARD_SIGNING_KEY=KEY, SPIKEGUARD_BOOTSTRAP_SERVERS=kafka_bootstrap)
    bare = sign_action(
        Action(
            action_id="bare-stop",
            run_id="op-run",
            kind=ActionKind.STOP,
            apply_at_step=1,
            params={"reason": "no evidence"},
        ),
        KEY,
    )
    operator = None
    try:
        x, y = torch.randn(64, 4), torch.randn(64, 1)
        deadline = time.monotonic() + 120
        while not guard.should_stop and time.monotonic() < deadline:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            guard.step(loss)
            if guard.step_count == 20:
                guard.publisher.flush(5.0)  # the steps are on the broker for the operator to read
                bus.producer().publish(topics.actions, encode(bare), key="op-run")
                operator = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "spikeguard",
                        "stop",
                        "op-run",
                        "--reason",
                        "maintenance window",
                        "--topic-prefix",
                        prefix,
                        "--wait",
                        "60",
                    ],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            time.sleep(0.01)
        assert guard.should_stop and "maintenance window" in guard.stop_reason
    finally:
        guard.close()
    out, _ = operator.communicate(timeout=90)
    assert operator.returncode == 0 and "applied" in out, out
    acks = {a.action_id: a for a in (decode(r.value, Ack) for r in bus.read_all(topics.acks))}
    assert (
        acks["bare-stop"].status is AckStatus.REJECTED and "no evidence" in acks["bare-stop"].result
    )
    bus.close()
