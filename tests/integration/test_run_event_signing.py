"""On a real broker: forged run events cannot disarm a run (the runs topic is signed).

``spikeguard worker all`` (the six components, each its own consumer group)
runs with ``SPIKEGUARD_SIGNING_KEY`` from its environment, as docker-compose.yml
starts the workers. A run's genuine start, signed with the key, is applied:
the actuator answers it with the preset's cadence alert. Forged starts (unsigned,
or signed with another key) that would switch off fusion's weights and the
policy's rollbacks are refused by every component to the DLQ with the reason,
and the run is still judged under the settings it really has. The fusion
worker, like the actuator, does not start on Kafka without a key unless told.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from spikeguard.bus.kafka import KafkaBus
from spikeguard.components import COMPONENTS, DETECTOR_NAMES
from spikeguard.schemas import (
    Action,
    ActionKind,
    AnomalyType,
    DeadLetter,
    Decision,
    RunEvent,
    Topics,
    Verdict,
    decode,
    encode,
)
from spikeguard.schemas.signing import sign, sign_run_event, verify_action

pytestmark = pytest.mark.kafka
KEY = "run-events-signing-key-0123456789"


def worker_env(bootstrap: str, key: str | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SPIKEGUARD_SIGNING_KEY", "SPIKEGUARD_INSECURE")
    }
    env["SPIKEGUARD_BOOTSTRAP_SERVERS"] = bootstrap
    if key is not None:
        env["SPIKEGUARD_SIGNING_KEY"] = key
    return env


def until(check, what: str, within_s: float = 120.0):
    """Poll ``check()`` until truthy (a bound on a hung pipeline, not a speed check)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"not within {within_s} s: {what}")


def test_forged_run_starts_are_refused_by_every_kafka_worker_and_the_genuine_one_applies(
    kafka_bootstrap, tmp_path
):
    prefix = f"runsign-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [sys.executable, "-m", "spikeguard", "worker", "all", "--topic-prefix", prefix],
        env=worker_env(kafka_bootstrap, KEY),
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
    )
    bus = KafkaBus(kafka_bootstrap)
    try:
        until(
            lambda: "spikeguard worker:" in log.read_text() or worker.poll() is not None,
            "worker start",
        )
        assert worker.poll() is None, log.read_text()
        producer = bus.producer()
        cadence = dict(
            checkpoint_every=10, keep_checkpoints=2
        )  # 10 steps back: the preset needs 30
        records = [
            # Run "b": its own start names the small preset; the forgers want no rollback ever.
            sign_run_event(RunEvent(run_id="b", kind="start", preset="small", **cadence), KEY),
            RunEvent(
                run_id="b",
                kind="start",
                step=1,
                policy={"rollback_min_steps_before_onset": 1_000_000},
                **cadence,
            ),
            sign_run_event(
                RunEvent(
                    run_id="b",
                    kind="start",
                    step=2,
                    **cadence,
                    policy={"rollback_min_steps_before_onset": 500_000},
                ),
                "another key",
            ),
            # Run "a": a forged start that weighs every detector's anomaly at nothing.
            RunEvent(
                run_id="a",
                kind="start",
                fusion={
                    "threshold": 1.0,
                    "default_weight": 0.0,
                    "weights": {d: 0.0 for d in DETECTOR_NAMES},
                },
            ),
        ]
        for event in records:
            producer.publish(topics.runs, encode(event), key=event.run_id)
        producer.flush()

        def refused():
            letters = [decode(r.value, DeadLetter) for r in bus.read_all(topics.dlq, timeout=2.0)]
            letters = [l for l in letters if l.source_topic == topics.runs]
            return letters if len(letters) >= 3 * len(COMPONENTS) else None

        letters = until(refused, "every component refused the three forged starts")
        assert len(letters) == 3 * len(COMPONENTS)
        assert {l.error for l in letters} == {"RunEventNotAuthenticated"}
        for name in COMPONENTS:
            reasons = sorted(l.reason for l in letters if l.consumer == f"{prefix}{name}")
            assert len(reasons) == 3, (name, reasons)
            assert reasons[0].startswith("run a start: no signature")
            assert reasons[1].startswith("run b start: bad signature")
            assert reasons[2].startswith("run b start: no signature")

        # Run "a" is judged under fusion's own settings: one statistical anomaly of 0.7 flags the step.
        for name in DETECTOR_NAMES:
            flagged = name == "statistical"
            producer.publish(
                topics.verdicts,
                encode(
                    sign(
                        Verdict(  # signed, as the detector workers sign
                            run_id="a",
                            step=0,
                            detector=name,
                            is_anomaly=flagged,
                            confidence=0.7 if flagged else 0.0,
                            type=AnomalyType.LOSS_SPIKE if flagged else AnomalyType.NONE,
                            loss=1.0,
                            grad_norm=1.0,
                        ),
                        KEY,
                    )
                ),
                key="a",
            )
        producer.flush()
        decided = until(
            lambda: [
                d
                for d in (
                    decode(r.value, Decision) for r in bus.read_all(topics.decisions, timeout=2.0)
                )
                if d.run_id == "a"
            ],
            "fusion's decision for run a",
        )
        assert [(d.step, d.is_anomaly) for d in decided] == [(0, True)]

        # Run "b" got its own (signed) preset: the actuator's cadence alert names the preset's 30 steps.
        def alerts():
            found = [
                a
                for a in (
                    decode(r.value, Action) for r in bus.read_all(topics.actions, timeout=2.0)
                )
                if a.run_id == "b"
            ]
            return found or None

        actions = until(alerts, "the actuator's answer to run b's start")
        assert [a.kind for a in actions] == [ActionKind.ALERT] and verify_action(actions[0], KEY)
        assert "rollback_min_steps_before_onset=30 " in actions[0].reason
        assert worker.poll() is None, log.read_text()
    finally:
        bus.close()
        worker.terminate()
        try:
            worker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            worker.kill()
    assert worker.returncode == 0, log.read_text()


@pytest.mark.parametrize("name", ["fusion", "statistical", "detectors"])
def test_every_worker_refuses_to_start_on_kafka_without_a_key(kafka_bootstrap, name):
    """Detector workers too: without the key their verdicts are refused downstream, and they take anyone's steps."""
    prefix = f"runsign-{uuid.uuid4().hex[:8]}."
    refused = subprocess.run(
        [sys.executable, "-m", "spikeguard", "worker", name, "--topic-prefix", prefix],
        env=worker_env(kafka_bootstrap, None),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    [line] = [l for l in (refused.stdout + refused.stderr).splitlines() if l.strip()]
    assert (
        f"the {name} worker refuses to start on Kafka without a signing key" in line
        and "--insecure" in line
    )
