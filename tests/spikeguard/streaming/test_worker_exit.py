"""A worker that cannot go on exits non-zero with a one-line reason (a supervisor restarts it),
and saves nothing past what it delivered."""

import os
import subprocess
import sys

from spikeguard.bus import EmbeddedBus
from spikeguard.schemas import StepEvent, Topics, encode
from spikeguard.streaming.state_store import StateStore

TOPICS = Topics("exit-test.")


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SPIKEGUARD_")}


def test_a_worker_that_cannot_publish_exits_non_zero_with_a_one_line_reason(tmp_path):
    recorded = EmbeddedBus(partitions=1, data_dir=tmp_path)
    producer = recorded.producer()
    for step in range(20):
        event = StepEvent(run_id="r", step=step, loss=1.0 + step * 0.01, time=0.0)
        producer.publish(TOPICS.steps, encode(event), key="r")
    producer.flush()
    recorded.close()
    # Where the verdicts would be recorded is a file: every publish fails (a disk fault).
    (tmp_path / TOPICS.verdicts).write_text("in the way")

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spikeguard",
            "worker",
            "statistical",
            "--topic-prefix",
            TOPICS.prefix,
            "--set",
            f"data_dir={tmp_path}",
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("spikeguard worker: cannot go on: statistical: FileExistsError: "), last
    assert str(tmp_path / TOPICS.verdicts) in last
    # Nothing saved or committed past the undelivered verdicts: a restart redoes them.
    reopened = EmbeddedBus(partitions=1, data_dir=tmp_path)
    assert StateStore(reopened, TOPICS.state("statistical")).load(0) is None
    assert reopened._groups.get(f"{TOPICS.prefix}statistical") is None
