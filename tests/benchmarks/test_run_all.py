"""benchmarks/run_all.py names every row of docs/benchmarks.md's speed table with a script that exists."""

from __future__ import annotations

import json
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


def test_quick_runs_the_four_headline_rows_smaller(tmp_path):
    listed = subprocess.run(
        [sys.executable, str(BENCH / "run_all.py"), "--quick", "--list", "--out", str(tmp_path),
         "--bootstrap", "127.0.0.1:1"],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    rows = dict(line.split(": ", 1) for line in listed)
    assert set(rows) == {"backtest", "embedded_cost", "kafka_throughput", "kafka_latency"}
    assert "--steps 20000" in rows["backtest"] and "--memory" not in rows["backtest"]


def test_each_headline_row_is_printed_beside_its_aim(tmp_path):
    """The summary reads each benchmark's JSON as the benchmark writes it (shapes taken
    from real runs) and puts each figure beside its aim."""
    sys.path.insert(0, str(BENCH))
    try:
        import run_all
    finally:
        sys.path.remove(str(BENCH))
    (tmp_path / "backtest.json").write_text(json.dumps({"process": {
        "steps": 20000, "backtest_steps_per_s": 5000.0, "backtest_over_naive": 0.9,
        "backtest_steps_per_cpu_s": 8000.0}}))
    (tmp_path / "embedded_cost.txt").write_text("warming up\n" + json.dumps(
        {"ratio": 0.95, "ratio_range": [0.9, 1.0], "ratio_process": 0.5,
         "paired": {"ratio": 0.93, "hook_share": 0.031, "missed": 0.0}}) + "\n")
    (tmp_path / "kafka_throughput.txt").write_text(json.dumps({
        "raw": {"steps_per_s": 14000}, "raw_confluent": {"steps_per_s": 40000},
        "pipelines": {"confluent/cohosted": {"steps_per_s": 21000}}}) + "\n")
    (tmp_path / "kafka_latency.txt").write_text(json.dumps({
        "confluent/cohosted": {"rate": 1000.0, "decision_ms": {"p50": 15, "p99": 250}}}) + "\n")
    lines = run_all.headline(tmp_path, ["backtest", "embedded_cost", "kafka_throughput", "kafka_latency"])
    text = "\n".join(lines)
    assert "20,000-step CSV" in text and "5,000 steps/s" in text and "[aim >= 20k steps/s, >= 4x: missed]" in text
    assert "0.95x (rounds 0.90-1.00)  [aim >= 0.9x: met]" in text
    assert "21,000 steps/s, 0.53x the raw confluent loop  [aim >= 10k steps/s, >= 0.5x: met]" in text
    assert "p50 15 ms, p99 250 ms  [aim p50 <= 20 ms, p99 <= 100 ms: missed]" in text
    assert "0.93x  [aim >= 0.9x: met]" in text and "+3.1%  [aim < 2%: missed]" in text
    assert len(lines) == 8  # paired: ratio, hook, missed; threads and child process; throughput, latency, backtest
