"""``spikeguard replay`` checks signatures as the live consumers do, and counts what it leaves out.

A run recorded by the embedded bus with a known key, then two records written into the
recording by someone without it: an unsigned healthy checkpoint newer than the real ones
(it would become the rollback target) and a step signed with another key.
"""

from __future__ import annotations

import math

import pytest

from spikeguard.bus import EmbeddedBus
from spikeguard.cli import main
from spikeguard.runtime import open_runtime
from spikeguard.schemas import CheckpointEvent, StepEvent, encode
from spikeguard.schemas.signing import sign
from spikeguard.settings import load_settings

KEY = "replay-signatures-key-0123456789abcdef"


def healthy_loss(step: int) -> float:
    return 3.0 * (step + 10) ** -0.3 * (1 + 0.01 * math.sin(step * 1.7))


@pytest.fixture(scope="module")
def tampered(tmp_path_factory, wait_until, consumed_by):
    directory = tmp_path_factory.mktemp("rec")
    settings = load_settings({"data_dir": str(directory), "signing_key": KEY}, env={})
    with open_runtime(settings) as runtime:
        producer = runtime.bus.producer()
        for step in range(400):
            loss = math.nan if step in (300, 301) else healthy_loss(step)
            producer.publish(
                runtime.topics.steps,
                encode(sign(StepEvent(run_id="rec", step=step, loss=loss), KEY)),
                key="rec",
            )
            if step % 50 == 0 and 0 < step < 300:
                producer.publish(
                    runtime.topics.checkpoints,
                    encode(
                        sign(
                            CheckpointEvent(
                                run_id="rec", step=step, checkpoint_id=f"c{step}", healthy=True
                            ),
                            KEY,
                        )
                    ),
                    key="rec",
                )
        producer.flush()
        wait_until(
            lambda: len(runtime.bus.read_all(runtime.topics.decisions)) >= 400,
            "a decision on every step",
        )
        decided = len(runtime.bus.read_all(runtime.topics.decisions))
        wait_until(
            lambda: consumed_by(runtime, "actuator", runtime.topics.decisions) >= decided,
            "the actuator took in every decision",
        )
        topics = runtime.topics
    bus = EmbeddedBus(data_dir=str(directory))
    producer = bus.producer()
    producer.publish(
        topics.checkpoints,
        encode(CheckpointEvent(run_id="rec", step=290, checkpoint_id="forged-c290", healthy=True)),
        key="rec",
    )
    producer.publish(
        topics.steps,
        encode(sign(StepEvent(run_id="rec", step=399, loss=1e9), "another-key-0123456789abcdef")),
        key="rec",
    )
    producer.flush()
    bus.close()
    return directory


def test_with_the_key_the_forged_records_are_left_out_and_counted(tampered, capsys, monkeypatch):
    monkeypatch.setenv("SPIKEGUARD_SIGNING_KEY", KEY)
    assert main(["replay", "--data-dir", str(tampered)]) == 0
    out = capsys.readouterr().out
    assert (
        "signatures checked: 2 record(s) not signed by their producer's key left out "
        "(checkpoints 1, steps 1)" in out
    ), out
    assert "actions: 0 added, 0 removed, 0 changed" in out, out  # the rollback still targets c200


def test_without_a_key_the_unsigned_record_is_flagged(tampered, capsys, monkeypatch):
    monkeypatch.delenv("SPIKEGUARD_SIGNING_KEY", raising=False)
    assert main(["replay", "--data-dir", str(tampered)]) == 0
    out = capsys.readouterr().out
    assert (
        "signatures NOT checked (no signing key): 1 record(s) carry no signature (checkpoints 1)"
        in out
    ), out
