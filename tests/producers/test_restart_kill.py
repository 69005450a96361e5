"""SIGKILL between checkpoints, restart from the newest: nothing is applied twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from spikeguard.bus import EmbeddedBus
from spikeguard.schemas import Ack, AckStatus, Topics, decode

WORKER = Path(__file__).with_name("restart_worker.py")


def _start(tmp_path, steps):
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(tmp_path / "ckpt"), str(tmp_path / "bus"), str(steps)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )


def test_killed_and_restarted_trainer_does_not_reapply_actions(tmp_path):
    first = _start(tmp_path, 40)
    lines = []
    for line in first.stdout:
        lines.append(json.loads(line))
        if lines[-1].get("step") == 17:  # action applied at 14, last checkpoint at 10, next at 20
            first.send_signal(signal.SIGKILL)
            break
    first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    assert lines[0]["resumed_from"] is None and lines[-1]["scale"] == 0.5
    ledger = json.loads((tmp_path / "ckpt" / "spikeguard-ledger.json").read_text())
    assert "a-kill-1" in ledger["applied"]

    second = _start(tmp_path, 30)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0, out
    records = [json.loads(line) for line in out.splitlines()]
    assert records[0]["resumed_from"] == 10  # the newest checkpoint before the kill
    assert records[0]["scale"] == 0.5  # the applied action's effect survived via the ledger
    done = records[-1]
    assert done["done"] and done["scale"] == 0.5
    # The restarted trainer is a new session, whose inbox reads the actions partition from its
    # start: both deliveries of the action (one per start) come back, each found a duplicate.
    applied = [(a["action_id"], a["status"]) for a in done["applied"]]
    assert applied and set(applied) == {("a-kill-1", "duplicate")}, applied

    bus = EmbeddedBus(data_dir=tmp_path / "bus")
    statuses = [decode(r.value, Ack).status for r in bus.read_all(Topics().acks)]
    assert statuses.count(AckStatus.APPLIED) <= 1 and AckStatus.DUPLICATE in statuses
    bus.close()
