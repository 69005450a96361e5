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
pytestmark = pytest.mark.slow


class Examples:
    """The JSON object each example prints last, run once per (example, fault) in this module.

    An example's first use starts all its faults at once: each run mostly waits on
    its lockstep pipeline, so three side by side take about the time of one or two.
    """

    def __init__(self) -> None:
        self.results: dict[tuple[str, str], dict] = {}

    def __call__(self, name: str, fault: str) -> dict:
        if (name, fault) not in self.results:
            python = os.environ.get("SPIKEGUARD_PYTHON", sys.executable)
            runs = {
                f: subprocess.Popen(
                    [python, str(EXAMPLES / f"{name}.py"), "--fault", f, "--json"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for f in FAULTS
            }
            for f, run in runs.items():
                try:
                    out, err = run.communicate(timeout=300)
                except subprocess.TimeoutExpired:
                    for other in runs.values():
                        other.kill()
                    raise
                assert run.returncode == 0, f"{name} --fault {f}: {err[-3000:]}"
                self.results[(name, f)] = json.loads(out.strip().splitlines()[-1])
        return self.results[(name, fault)]


@pytest.fixture(scope="module")
def run_example() -> Examples:
    """Module-scoped, so that the module's tests share one process and each example runs once."""
    return Examples()


def check_recovers(run_example: Examples, name: str) -> None:
    clean, spiked = run_example(name, "none"), run_example(name, "spike")
    assert clean["rollbacks"] == 0
    assert spiked["rollbacks"] >= 1
    assert (
        abs(spiked["final_eval_loss"] - clean["final_eval_loss"]) <= 0.02 * clean["final_eval_loss"]
    ), (clean, spiked)


def test_plain_loop_rolls_back_a_spike_and_ends_as_the_clean_run(run_example):
    check_recovers(run_example, "plain_loop")


def test_plain_loop_survives_nan_batches(run_example):
    clean, poisoned = run_example("plain_loop", "none"), run_example("plain_loop", "nan")
    assert poisoned["skipped_updates"] >= 1
    assert (
        abs(poisoned["final_eval_loss"] - clean["final_eval_loss"])
        <= 0.02 * clean["final_eval_loss"]
    )


def test_hf_trainer_rolls_back_a_spike_and_ends_as_the_clean_run(run_example):
    pytest.importorskip("transformers")
    check_recovers(run_example, "hf_trainer")
    assert run_example("hf_trainer", "spike")["global_step"] == 300


def test_hf_trainer_survives_nan_batches(run_example):
    pytest.importorskip("transformers")
    clean, poisoned = run_example("hf_trainer", "none"), run_example("hf_trainer", "nan")
    assert poisoned["rollbacks"] + poisoned["skipped_updates"] >= 1
    assert (
        abs(poisoned["final_eval_loss"] - clean["final_eval_loss"])
        <= 0.02 * clean["final_eval_loss"]
    )


def test_lightning_trainer_rolls_back_a_spike_and_ends_as_the_clean_run(run_example):
    pytest.importorskip("lightning")
    check_recovers(run_example, "lightning_trainer")
    assert run_example("lightning_trainer", "spike")["global_step"] == 300


def test_lightning_trainer_survives_nan_batches(run_example):
    pytest.importorskip("lightning")
    clean, poisoned = (
        run_example("lightning_trainer", "none"),
        run_example("lightning_trainer", "nan"),
    )
    assert poisoned["rollbacks"] + poisoned["skipped_updates"] >= 1
    assert (
        abs(poisoned["final_eval_loss"] - clean["final_eval_loss"])
        <= 0.02 * clean["final_eval_loss"]
    )
