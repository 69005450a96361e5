"""The examples, run as a user runs them: a spike makes each roll back and end as a clean run does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FAULTS = ("none", "spike", "nan")
_results: dict[tuple[str, str], dict] = {}


def run_example(name: str, fault: str) -> dict:
    """The JSON object the example prints last, run once per (example, fault) in this session.

    An example's first use starts all its faults at once: each run mostly waits on
    its lockstep pipeline, so three side by side take about the time of one or two.
    """
    if (name, fault) not in _results:
        python = os.environ.get("SPIKEGUARD_PYTHON", sys.executable)
        runs = {f: subprocess.Popen([python, str(EXAMPLES / f"{name}.py"), "--fault", f, "--json"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for f in FAULTS}
        for f, run in runs.items():
            try:
                out, err = run.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                for other in runs.values():
                    other.kill()
                raise
            assert run.returncode == 0, f"{name} --fault {f}: {err[-3000:]}"
            _results[(name, f)] = json.loads(out.strip().splitlines()[-1])
    return _results[(name, fault)]


def check_recovers(name: str) -> None:
    clean, spiked = run_example(name, "none"), run_example(name, "spike")
    assert clean["rollbacks"] == 0
    assert spiked["rollbacks"] >= 1
    assert abs(spiked["final_eval_loss"] - clean["final_eval_loss"]) <= 0.02 * clean["final_eval_loss"], \
        (clean, spiked)


@pytest.mark.slow
def test_plain_loop_rolls_back_a_spike_and_ends_as_the_clean_run():
    check_recovers("plain_loop")


@pytest.mark.slow
def test_plain_loop_survives_nan_batches():
    clean, poisoned = run_example("plain_loop", "none"), run_example("plain_loop", "nan")
    assert poisoned["skipped_updates"] >= 1
    assert abs(poisoned["final_eval_loss"] - clean["final_eval_loss"]) <= 0.02 * clean["final_eval_loss"]


@pytest.mark.slow
def test_hf_trainer_rolls_back_a_spike_and_ends_as_the_clean_run():
    pytest.importorskip("transformers")
    check_recovers("hf_trainer")
    assert run_example("hf_trainer", "spike")["global_step"] == 300


@pytest.mark.slow
def test_hf_trainer_survives_nan_batches():
    pytest.importorskip("transformers")
    clean, poisoned = run_example("hf_trainer", "none"), run_example("hf_trainer", "nan")
    assert poisoned["rollbacks"] + poisoned["skipped_updates"] >= 1
    assert abs(poisoned["final_eval_loss"] - clean["final_eval_loss"]) <= 0.02 * clean["final_eval_loss"]


@pytest.mark.slow
def test_lightning_trainer_rolls_back_a_spike_and_ends_as_the_clean_run():
    pytest.importorskip("lightning")
    check_recovers("lightning_trainer")
    assert run_example("lightning_trainer", "spike")["global_step"] == 300


@pytest.mark.slow
def test_lightning_trainer_survives_nan_batches():
    pytest.importorskip("lightning")
    clean, poisoned = run_example("lightning_trainer", "none"), run_example("lightning_trainer", "nan")
    assert poisoned["rollbacks"] + poisoned["skipped_updates"] >= 1
    assert abs(poisoned["final_eval_loss"] - clean["final_eval_loss"]) <= 0.02 * clean["final_eval_loss"]
