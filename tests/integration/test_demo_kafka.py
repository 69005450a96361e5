"""``spikeguard demo`` on a real broker recovers as it does embedded.

The six workers are started as docs/kafka.md says (``spikeguard worker NAME
--bootstrap-servers ... --instance-id NAME-0``), with their own default
settings; the demo process is a user's ``spikeguard demo`` with
SPIKEGUARD_BOOTSTRAP_SERVERS set. The demo's tuned policy lives in the demo
process only: it reaches the workers on the runs topic (the Guard's RunEvent),
or the pipeline would answer with its defaults (once: 0 rollbacks, final loss
2.087 against 1.780 embedded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from spikeguard.demo.run import run_demo

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
COMPONENTS = ("statistical", "rules", "ml", "predictor", "fusion", "actuator")


def spikeguard(*args: str) -> list[str]:
    return [sys.executable, "-m", "spikeguard", *args]


@pytest.fixture
def readme_workers(kafka_bootstrap, tmp_path):
    prefix = f"demo-{uuid.uuid4().hex[:8]}."
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}
    env.update(
        SPIKEGUARD_SIGNING_KEY="demo-kafka-key-" + uuid.uuid4().hex, SPIKEGUARD_TOPIC_PREFIX=prefix
    )
    workers, logs = [], []
    for name in COMPONENTS:
        log = tmp_path / f"{name}.log"
        logs.append(log)
        workers.append(
            subprocess.Popen(
                spikeguard(
                    "worker",
                    name,
                    "--bootstrap-servers",
                    kafka_bootstrap,
                    "--instance-id",
                    f"{name}-0",
                ),
                env=env,
                stdout=log.open("w"),
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        deadline = time.monotonic() + 120
        for worker, log in zip(workers, logs):
            while "spikeguard worker:" not in log.read_text():
                assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        yield {**env, "SPIKEGUARD_BOOTSTRAP_SERVERS": kafka_bootstrap}, logs
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()


def test_the_demo_on_kafka_with_the_readmes_workers_recovers_like_embedded(readme_workers):
    env, logs = readme_workers
    done = subprocess.run(
        spikeguard("demo", "--fault", "spike", "--json", "--plot", ""),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    kafka = json.loads(done.stdout.strip().splitlines()[-1])
    clean = run_demo("none", seed=0, guarded=False).final_eval_loss
    embedded = run_demo("spike", seed=0, guarded=True)
    print(
        f"clean {clean:.4f} embedded {embedded.final_eval_loss:.4f} (rollbacks {embedded.rollbacks}) "
        f"kafka {kafka['final_eval_loss']:.4f} (rollbacks {kafka['rollbacks']}, "
        f"actions {kafka['actions_applied']})"
    )
    assert kafka["steps"] == 300 and kafka["rollbacks"] >= 1 and kafka["skipped_batches"] > 0
    assert abs(kafka["final_eval_loss"] - clean) <= 0.02 * clean
    assert abs(kafka["final_eval_loss"] - embedded.final_eval_loss) <= 0.02 * clean
    assert kafka["nonfinite_updates"] == 0
    for log in logs:  # no worker refused the run's settings or fell over
        text = log.read_text()
        assert "Traceback" not in text and "DLQ" not in text, text[-2000:]
