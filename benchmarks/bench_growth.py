"""Growth benchmark: the backtest's measures at 10x more steps per run.

    python benchmarks/bench_growth.py [--steps 10000] [--factor 10] [--pairs 1]
                                      [--workdir /tmp/spikeguard-bench] [--json results.json]

Flat means the cost per step does not grow with the run's length. Two views:

- **whole process**: ``spikeguard backtest FILE`` on one run of ``--steps``
  steps and on one run of ``--factor`` times as many (CSVs made by
  ``spikeguard simulate stable``, cached in --workdir), run in turn: steps per
  CPU-second (steadier than wall time on a shared machine; start-up weighs
  more on the short file, so this ratio is a lower bound) and peak RSS;
- **inside the long run**: the pipeline (all detectors + fusion, driven as
  the backtest drives them) over the long run, segment by segment; CPU
  microseconds per step over the first tenth after warm-up (skipping the
  first segment: imports, the first forest fit) against the last tenth, for
  the pipeline and for each stage.

Aim: the long run's cost per step within 1.25x of the short one's, and the
end of the long run within 1.25x of its start. A benchmark, not a test: it
reports, it does not fail.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy loads its thread pool

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_backtest import backtest_command, ensure_file, run_child, timed_batch  # noqa: E402

FLAT = 1.25  # a growth ratio up to this counts as flat (shared-machine noise is ~10-20%)


def measure_processes(steps: int, factor: int, pairs: int, workdir: str, seed: int) -> dict:
    sizes = (steps, steps * factor)
    paths = {n: ensure_file(workdir, "stable", n, seed) for n in sizes}
    out = os.path.join(workdir, "growth-out.jsonl")
    runs: dict[int, list[tuple[float, int, float]]] = {n: [] for n in sizes}
    for _ in range(pairs):  # short, long, short, long: drift hits both alike
        for n in sizes:
            runs[n].append(run_child(backtest_command(paths[n], out)))
    rows = {}
    for n in sizes:
        wall = statistics.median(r[0] for r in runs[n])
        cpu = statistics.median(r[2] for r in runs[n])
        rows[str(n)] = {
            "steps": n,
            "wall_s": wall,
            "cpu_s": cpu,
            "steps_per_s": n / wall,
            "steps_per_cpu_s": n / cpu,
            "cpu_us_per_step": 1e6 * cpu / n,
            "peak_rss_bytes": max(r[1] for r in runs[n]),
        }
    short, long = rows[str(sizes[0])], rows[str(sizes[1])]
    return {
        "runs": rows,
        "cost_per_step_long_over_short": long["cpu_us_per_step"] / short["cpu_us_per_step"],
        "peak_rss_long_over_short": long["peak_rss_bytes"] / short["peak_rss_bytes"],
    }


def measure_inside(steps: int, workdir: str, seed: int) -> dict:
    """CPU cost per step, per segment of the long run, by stage."""
    from spikeguard.lab.backtest import SEGMENT_STEPS, offline
    from spikeguard.lab.backtest_input import iter_steps
    from spikeguard.lab.backtest_pump import DirectPipeline
    from spikeguard.settings import load_settings

    pipeline = DirectPipeline(offline(load_settings(env={})))
    spent: dict[str, float] = {}

    for stage in (*pipeline._detectors, pipeline._fusion):
        # A profiler's wrapper, set on the instance: its class's method is left alone.
        stage.handle_batch = timed_batch(stage, spent)  # type: ignore[method-assign]
    path = ensure_file(workdir, "stable", steps, seed)
    segments: list[dict[str, float]] = []
    segment: list = []

    def feed() -> None:
        spent.clear()
        gc.disable()  # as the backtest does while a segment runs
        started = time.process_time()
        pipeline.feed(segment)
        total = time.process_time() - started
        gc.enable()
        segments.append({"steps": len(segment), "pipeline": total, **spent})

    for event in iter_steps(path):
        segment.append(event)
        if len(segment) == SEGMENT_STEPS:
            feed()
            segment = []
    if segment:
        feed()
    full = [s for s in segments[1:] if s["steps"] == SEGMENT_STEPS]  # no warm-up, no stub
    tenth = max(1, len(full) // 10)
    start, end = full[:tenth], full[-tenth:]

    def per_step(chunk: list[dict[str, float]], key: str) -> float:
        return 1e6 * statistics.median(s.get(key, 0.0) for s in chunk) / SEGMENT_STEPS

    keys = ["pipeline", *(s.name for s in pipeline._detectors), "fusion"]
    table = {
        key: {"start_us_per_step": per_step(start, key), "end_us_per_step": per_step(end, key)}
        for key in keys
    }
    for row in table.values():
        row["end_over_start"] = row["end_us_per_step"] / max(row["start_us_per_step"], 1e-9)
    return {"steps": steps, "segment_steps": SEGMENT_STEPS, "segments_each": tenth, "stages": table}


def render(report: dict) -> str:
    p, inside = report["process"], report["inside"]
    lines = ["whole process (spikeguard backtest, stable run, medians):"]
    for row in p["runs"].values():
        lines.append(
            f"  {row['steps']:>9,} steps: {row['steps_per_s']:>8,.0f} steps/s, "
            f"{row['steps_per_cpu_s']:>8,.0f} steps/CPU-s ({row['cpu_us_per_step']:.1f} us/step), "
            f"peak RSS {row['peak_rss_bytes'] / 2**20:,.0f} MiB"
        )
    ratio = p["cost_per_step_long_over_short"]
    lines.append(
        f"  cost per step, long / short: {ratio:.2f}x "
        f"({'flat' if ratio <= FLAT else 'GROWS'}; start-up weighs more on the short run)"
    )
    lines.append(f"  peak RSS, long / short: {p['peak_rss_long_over_short']:.2f}x")
    lines.append(
        f"inside the {inside['steps']:,}-step run: CPU us per step, first vs last "
        f"{inside['segments_each']} segments of {inside['segment_steps']:,} (medians)"
    )
    for key, row in inside["stages"].items():
        verdict = "flat" if row["end_over_start"] <= FLAT else "GROWS"
        lines.append(
            f"  {key:<12} {row['start_us_per_step']:>7.1f} -> {row['end_us_per_step']:>7.1f}"
            f"  ({row['end_over_start']:.2f}x) {verdict}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000, help="the short run")
    parser.add_argument(
        "--factor", type=int, default=10, help="the long run is this many times longer"
    )
    parser.add_argument("--pairs", type=int, default=1, help="short/long process pairs")
    parser.add_argument("--workdir", default=os.path.join("/tmp", "spikeguard-bench"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    report = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "process": measure_processes(args.steps, args.factor, args.pairs, args.workdir, args.seed),
        "inside": measure_inside(args.steps * args.factor, args.workdir, args.seed),
    }
    print(render(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
