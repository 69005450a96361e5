"""benchmarks/run_all.py names every row of docs/benchmarks.md's speed table with a script that exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_every_row_has_a_command_whose_script_exists(tmp_path):
    listed = subprocess.run(
        [sys.executable, str(BENCH / "run_all.py"), "--list", "--out", str(tmp_path), "--bootstrap", "127.0.0.1:1"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    rows = dict(line.split(": ", 1) for line in listed)
    # backtest throughput + memory, growth, hook overhead, gradient statistics, embedded cost,
    # scale in runs, Kafka throughput and latency: nine rows in eight commands.
    assert set(rows) == {"backtest", "growth", "guard_overhead", "grad_stats", "embedded_cost",
                         "scale_runs", "kafka_throughput", "kafka_latency"}
    for name, command in rows.items():
        script = Path(command.split()[1])
        assert script.is_file(), f"{name}: {script} is missing"
    assert "--memory" in rows["backtest"]
    assert "127.0.0.1:1" in rows["kafka_throughput"] and "127.0.0.1:1" in rows["kafka_latency"]
