"""benchmarks/stage_clock.py: each stage's CPU counted once, nested stages apart; profile_stages.py's rows add up."""

from __future__ import annotations

import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
try:
    from profile_stages import per_step
    from stage_clock import StageClock
finally:
    sys.path.remove(str(BENCH))


def _spin(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU (CPU time: the machine's load does not stretch it)."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_nested_stages_are_counted_exclusively_and_add_up_to_the_thread():
    clock = StageClock()
    inner = clock.timed("inner", lambda: _spin(0.03))

    def outer_work() -> None:
        _spin(0.03)
        inner()
        inner()

    outer = clock.timed("outer", outer_work)
    started = time.thread_time()
    outer()
    spent = time.thread_time() - started
    assert dict(clock.calls) == {"outer": 1, "inner": 2}
    assert clock.seconds["inner"] >= 0.06
    assert 0.03 <= clock.seconds["outer"] < 0.05  # its own spin, not its two inner calls
    assert abs(sum(clock.seconds.values()) - spent) < 0.01
    assert (
        clock.wall["inner"] >= clock.seconds["inner"] * 0.99
    )  # wall includes any wait for the CPU


def test_a_report_reads_as_cpu_per_step_with_the_loop_and_the_other_threads():
    report = {
        "thread_cpu_s": 1.0,
        "process_cpu_s": 1.5,
        "process_cpu_before_s": 0.5,
        "whole_command": False,
        "wall_s": 4.0,
        "stages_cpu_s": {"decode": 0.6, "sign": 0.3},
        "stages_wall_s": {"decode": 1.0, "sign": 1.0},
    }
    rows = {row.stage: row for row in per_step(report, steps=1000)}
    assert rows["decode"].cpu_us == 600.0 and rows["sign"].cpu_us == 300.0
    assert round(rows["the loop (no timer)"].cpu_us, 6) == 100.0
    assert rows["other threads (Kafka client)"].cpu_us == 500.0
    assert sum(row.cpu_us for row in rows.values()) == 1500.0  # the process's CPU, nothing twice
    assert rows["decode"].wall_share == 0.25 and rows["the loop (no timer)"].wall_share == 0.5
    assert "start-up (interpreter, imports)" not in rows  # a worker loop's start-up is not its cost
    command = per_step({**report, "whole_command": True}, steps=1000)
    assert command[-1].stage == "start-up (interpreter, imports)" and command[-1].cpu_us == 500.0
