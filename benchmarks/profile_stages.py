"""CPU microseconds per step, stage by stage, from ``cprofile_spikeguard.py``'s output.

    python benchmarks/profile_stages.py --steps 20000 DIR_OR_FILE.json ...   # stage timers
    python benchmarks/profile_stages.py --steps 20000 --top 25 FILE.prof ...   # cProfile, inside a stage
    python benchmarks/profile_stages.py --steps 20000 --markdown DIR/*.*.json   # the workers side by side

A stage-timer JSON gives one table per process: each stage's exclusive CPU per
step, what no timer covers in the profiled thread ("the loop"), the process's
other threads (the Kafka client's own: librdkafka's ``rdk:*`` threads or
kafka-python's sender) and, for a whole command (a backtest), what ran before
it (interpreter start and imports). A ``.prof`` gives the functions with the
most cumulative CPU per step, for the shares inside a stage (cProfile's own
overhead, ~0.8 µs per Python call on the CPU clock, inflates those with many
small calls; divide by the thread's unprofiled CPU to compare).
"""

from __future__ import annotations

import argparse
import json
import pstats
import sys
from pathlib import Path
from typing import Any, NamedTuple


class Row(NamedTuple):
    """One stage of a stage-timer report: CPU µs per step, and its share of the loop's wall time."""

    stage: str
    cpu_us: float
    wall_share: float | None  # None: not in the profiled thread's wall time (other threads)


def per_step(report: dict[str, Any], steps: int) -> list[Row]:
    """The rows of one stage-timer report, largest CPU first, then what no timer covers."""
    cpu, wall = report["stages_cpu_s"], report.get("stages_wall_s", {})
    total_wall = report.get("wall_s") or 0.0
    share = (lambda s: s / total_wall) if total_wall else (lambda s: None)
    rows = [
        Row(name, 1e6 * seconds / steps, share(wall.get(name, 0.0)))
        for name, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])
        if 1e6 * seconds / steps >= 0.05
    ]  # a seam the command went through without work
    rows.append(
        Row(
            "the loop (no timer)",
            1e6 * (report["thread_cpu_s"] - sum(cpu.values())) / steps,
            share(total_wall - sum(wall.values())) if wall else None,
        )
    )
    others = report["process_cpu_s"] - report["thread_cpu_s"]
    if others > 0.005 * report["process_cpu_s"]:
        rows.append(Row("other threads (Kafka client)", 1e6 * others / steps, None))
    if whole_command(report):
        rows.append(
            Row(
                "start-up (interpreter, imports)",
                1e6 * report["process_cpu_before_s"] / steps,
                None,
            )
        )
    return rows


def whole_command(report: dict[str, Any]) -> bool:
    """A report of a whole command (a backtest), whose start-up is part of its cost."""
    return bool(report.get("whole_command"))


def total_cpu_s(report: dict[str, Any]) -> float:
    """The process's CPU: the command's start-up included for a whole command."""
    return report["process_cpu_s"] + (
        report["process_cpu_before_s"] if whole_command(report) else 0.0
    )


def render(path: Path, report: dict[str, Any], steps: int) -> str:
    rows = per_step(report, steps)
    total = 1e6 * total_cpu_s(report) / steps
    lines = [
        f"{path.name}: {total:,.1f} CPU µs per step over {steps:,} steps "
        f"({steps / max(total_cpu_s(report), 1e-9):,.0f} steps per CPU-second)"
        + (f"; {report['wall_s']:,.1f} s of wall time" if report.get("wall_s") else "")
    ]
    for row in rows:
        wall = "" if row.wall_share is None else f"  {100 * row.wall_share:5.1f} % of the wall time"
        lines.append(
            f"  {row.stage:<36} {row.cpu_us:8.1f} µs  {100 * row.cpu_us / total:5.1f} %{wall}"
        )
    return "\n".join(lines)


def markdown(reports: dict[str, dict[str, Any]], steps: int) -> str:
    """One table for several processes (a pipeline's workers): a column each, and their sum."""
    columns = {
        name: {row.stage: row.cpu_us for row in per_step(report, steps)}
        for name, report in reports.items()
    }
    stages: dict[str, float] = {}
    for cpu in columns.values():
        for stage, us in cpu.items():
            stages[stage] = stages.get(stage, 0.0) + us
    lines = [
        f"| stage (CPU µs per step) | {' | '.join(columns)} | all |",
        "|---|" + "---:|" * (len(columns) + 1),
    ]
    for stage, total in sorted(stages.items(), key=lambda kv: -kv[1]):
        cells = " | ".join(f"{cpu[stage]:.1f}" if stage in cpu else "" for cpu in columns.values())
        lines.append(f"| {stage} | {cells} | {total:.1f} |")
    totals = [1e6 * total_cpu_s(report) / steps for report in reports.values()]
    lines.append(
        f"| **total** | {' | '.join(f'**{t:.1f}**' for t in totals)} | **{sum(totals):.1f}** |"
    )
    return "\n".join(lines)


def top_functions(path: Path, steps: int, top: int) -> str:
    stats = pstats.Stats(str(path))
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:top]  # type: ignore[attr-defined]
    lines = [f"{path.name}: cumulative CPU µs per step (cProfile, its overhead included)"]
    for (filename, line, name), (_, calls, _tottime, cumtime, _) in rows:
        where = "/".join(Path(filename).parts[-2:]) if filename != "~" else ""
        lines.append(
            f"  {1e6 * cumtime / steps:8.1f} µs  {calls / steps:6.2f} calls/step  {where}:{line}({name})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "paths", nargs="+", help="stage-timer .json files or .prof files, or directories of them"
    )
    parser.add_argument(
        "--steps", type=int, required=True, help="the steps the profiled run judged"
    )
    parser.add_argument("--top", type=int, default=25, help="functions per .prof")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="the stage-timer files as one markdown table, a column each",
    )
    args = parser.parse_args(argv)
    files: list[Path] = []
    for given in map(Path, args.paths):
        files += (
            sorted(given.glob("*.json")) + sorted(given.glob("*.prof"))
            if given.is_dir()
            else [given]
        )
    if args.markdown:
        timers = [f for f in files if f.suffix == ".json" and not f.name.endswith(".prof.json")]
        print(
            markdown({f.stem.split(".")[-1]: json.loads(f.read_text()) for f in timers}, args.steps)
        )
        return 0
    for path in files:
        if path.suffix == ".prof":
            print(top_functions(path, args.steps, args.top))
        elif path.name.endswith(".prof.json"):
            continue
        else:
            print(render(path, json.loads(path.read_text()), args.steps))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
