"""Backtest benchmarks: throughput and memory, whole process, and a per-component table.

    python benchmarks/bench_backtest.py [--steps 100000] [--pairs 2] [--json results.json]
                                        [--memory [--memory-steps 1000000]]
                                        [--workdir /tmp/spikeguard-bench] [--split] [--components]

Whole process (the default), on CSVs made by ``spikeguard simulate stable``
(cached in --workdir, made once):

- **throughput**: ``spikeguard backtest FILE`` (all detectors + fusion) against
  the naive baseline over the same FILE (a process that streams the file
  through ``NaiveBaseline`` and writes its flags), run in turn A B A B ... so
  the ratio is taken pair by pair within one run. Aims: >= 20k steps/s and
  >= 4x the baseline (the baseline's time includes start-up and reading, as
  the backtest's does).
- **the limit**: beside each pair, a third process that starts as the backtest
  does, reads the file, replays the skip rule and runs the judging alone (each
  detector's and fusion's own objects, no stage, pump or output): what the
  backtest cannot go below with today's detectors. Reported: the backtest's
  CPU over it, and the best ratio to the baseline it leaves. The children run
  with cached bytecode (``child_env``).
- **memory** (``--memory``): the backtest's peak RSS (the child's own, from
  ``wait4``) on a 1M-step CSV, next to its peak on the --steps file, to show
  it is flat in the file's size. Aim: <= 400 MiB. Without ``--memory`` only
  the --steps file's peak is reported, and the default run (throughput,
  two pairs) takes well under 3 minutes.

``--split`` adds, in one process, the CPU time of each part of a backtest of
the --steps file (reading, each stage, the pump around them), for all the
detectors and without the ML one: where the whole-process figure goes.
``--components`` adds the older in-process table: the pipeline
(``backtest_events``), each detector alone through ``update_many`` in batches
of 500, the baselines through ``update``, one after the other on the same
events (OMP/MKL/torch pinned to one thread). A benchmark, not a test: it
reports, it does not fail.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy / torch load their thread pools

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Callable  # noqa: E402

BATCH = 500
AIMS = {
    "pipeline": 20_000,
    "statistical": 50_000,
    "rules": 50_000,
    "predictor": 50_000,
    "ml": 20_000,
}
PIPELINE_OVER_BASELINE = 4.0
PROCESS_AIM = 20_000  # steps/s, whole process
MEMORY_AIM = 400 * 2**20  # bytes of peak RSS on a 1M-step CSV


def _pin_torch() -> None:
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass


def _timed(fn: Callable[[], object], steps: int) -> dict:
    started = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - report and go on with the others
        traceback.print_exc(file=sys.stderr)
        return {"steps": steps, "seconds": None, "steps_per_s": None, "error": repr(exc)[:200]}
    seconds = time.perf_counter() - started
    return {"steps": steps, "seconds": seconds, "steps_per_s": steps / seconds, "error": None}


def _detector_runner(name: str, events) -> Callable[[], object]:
    def run() -> None:
        from spikeguard.processors.detectors import DETECTORS

        detector = DETECTORS[name]()
        for i in range(0, len(events), BATCH):
            detector.update_many(events[i : i + BATCH])

    return run


def measure(steps: int, scenario: str, seed: int) -> dict:
    from spikeguard.lab.baselines import NaiveBaseline, SixSigmaBaseline, flag_run
    from spikeguard.lab.simulate import generate

    _pin_torch()
    started = time.perf_counter()
    events = generate(scenario, steps, seed).events
    generation = time.perf_counter() - started

    try:
        from spikeguard.processors.detectors import DETECTORS

        names: list[str] = [
            n for n in ("statistical", "rules", "ml", "predictor") if n in DETECTORS
        ]
        missing = [n for n in ("statistical", "rules", "ml", "predictor") if n not in DETECTORS]
    except Exception as exc:  # noqa: BLE001
        names, missing = [], [f"detectors registry: {exc!r}"]

    def pipeline() -> None:
        from spikeguard.lab.backtest import backtest_events

        backtest_events(events)

    results: dict[str, dict] = {"pipeline": _timed(pipeline, steps)}
    for name in names:
        results[name] = _timed(_detector_runner(name, events), steps)
    results["naive"] = _timed(lambda: flag_run(NaiveBaseline(), events), steps)
    results["six_sigma"] = _timed(lambda: flag_run(SixSigmaBaseline(), events), steps)
    for name, result in results.items():
        aim = AIMS.get(name)
        rate = result["steps_per_s"]
        result["aim_steps_per_s"] = aim
        result["meets_aim"] = None if aim is None or rate is None else rate >= aim
    pipe, naive = results["pipeline"]["steps_per_s"], results["naive"]["steps_per_s"]
    ratio = pipe / naive if pipe and naive else None
    return {
        "steps": steps,
        "scenario": scenario,
        "seed": seed,
        "generation_seconds": generation,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "missing_detectors": missing,
        "results": results,
        "pipeline_over_naive": ratio,
        "pipeline_over_naive_aim": PIPELINE_OVER_BASELINE,
    }


def render(report: dict) -> str:
    lines = [
        f"backtest throughput: {report['steps']:,} steps of {report['scenario']} (seed "
        f"{report['seed']}), 1 thread, python {report['python']}",
        "",
        f"{'component':<12} {'seconds':>8} {'steps/s':>10} {'aim':>8}  status",
    ]
    for name, r in report["results"].items():
        if r["error"]:
            aim = _k(r["aim_steps_per_s"])
            lines.append(f"{name:<12} {'-':>8} {'-':>10} {aim:>8}  ERROR {r['error']}")
            continue
        status = {True: "ok", False: "BELOW AIM", None: ""}[r["meets_aim"]]
        lines.append(
            f"{name:<12} {r['seconds']:>8.2f} {r['steps_per_s']:>10,.0f} "
            f"{_k(r['aim_steps_per_s']):>8}  {status}"
        )
    ratio = report["pipeline_over_naive"]
    if ratio is not None:
        verdict = "ok" if ratio >= report["pipeline_over_naive_aim"] else "BELOW AIM"
        lines.append(
            f"\npipeline / naive baseline: {ratio:.2f}x (aim >= "
            f"{report['pipeline_over_naive_aim']:.0f}x)  {verdict}"
        )
    if report["missing_detectors"]:
        lines.append(f"not measured (missing): {', '.join(report['missing_detectors'])}")
    return "\n".join(lines)


def _k(aim: int | None) -> str:
    return "-" if aim is None else f">={aim // 1000}k"


# -- whole process ------------------------------------------------------------
def ensure_file(workdir: str, scenario: str, steps: int, seed: int) -> str:
    """A CSV of ``steps`` simulated steps, made once by ``spikeguard simulate``."""
    path = os.path.join(workdir, f"{scenario}-{steps}-{seed}.csv")
    if not os.path.exists(path):
        os.makedirs(workdir, exist_ok=True)
        partial = path + ".part.csv"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "spikeguard",
                "simulate",
                scenario,
                "--steps",
                str(steps),
                "--seed",
                str(seed),
                "--out",
                partial,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.replace(partial, path)
    return path


def child_env(workdir: str) -> dict[str, str]:
    """The children's environment: bytecode cached under ``workdir`` as an installed package's is.

    Without it, an environment that sets ``PYTHONDONTWRITEBYTECODE`` (this machine's does)
    makes every start compile the project from source: ~0.3 s of CPU more for the backtest,
    ~0.1 s for the baseline, which no user with an installed package pays.
    """
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(workdir, "pycache"))
    return env


def run_child(command: list[str], env: dict[str, str] | None = None) -> tuple[float, int, float]:
    """Wall seconds, peak RSS (bytes) and CPU seconds of one child process, start-up included.

    CPU time (user + system, the child's own) is the steadier figure on a shared machine.
    """
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: a chatty child cannot block
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(process.pid, 0)  # this child's own rusage
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-500:]
            raise RuntimeError(f"{' '.join(command)} exited {process.returncode}: {tail}")
    return seconds, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime  # maxrss: KiB


def start_up_cpu(workdir: str, env: dict[str, str]) -> dict[str, float]:
    """CPU seconds of each command on a file of no steps (its header alone): start-up and
    set-up, the part of a run that does not grow with the file (median of 3, after a warm-up)."""
    empty = os.path.join(workdir, "header-only.csv")
    with open(empty, "w", encoding="utf-8") as handle:
        handle.write("step,loss,grad_norm,lr,run_id\n")
    out = os.path.join(workdir, "empty-out.jsonl")
    found = {}
    for name, command in (
        ("backtest", backtest_command(empty, out)),
        ("naive", naive_command(empty, out)),
    ):
        run_child(command, env)
        found[name] = statistics.median(run_child(command, env)[2] for _ in range(3))
    return found


def backtest_command(path: str, out: str) -> list[str]:
    return [sys.executable, "-m", "spikeguard", "backtest", path, "--out", out]


def naive_command(path: str, out: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--naive-child", path, out]


def limit_command(path: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--limit-child", path]


def limit_child(path: str) -> int:
    """The backtest's limit as a whole process: its start-up (the CLI's parser, the pipeline's
    modules and stages), reading FILE, the skip rule's replay and the judging alone (each
    detector's and fusion's own objects, no stage or pump), the collector off as the
    backtest keeps it off. What a backtest of FILE cannot go below with today's detectors."""
    import gc

    from spikeguard.cli import build_parser
    from spikeguard.lab.backtest import offline
    from spikeguard.lab.backtest_input import iter_steps
    from spikeguard.settings import load_settings

    build_parser()
    gc.disable()
    settings = offline(load_settings(env={}))
    events = list(iter_steps(path))
    skip_rule_cpu(events)
    judging_cpu(settings, events)
    return 0


def naive_child(path: str, out: str) -> int:
    """The baseline's whole process: stream FILE through NaiveBaseline, write its flags."""
    from spikeguard.lab.backtest_input import iter_steps
    from spikeguard.lab.baselines import NaiveBaseline

    baselines: dict[str, NaiveBaseline] = {}
    with open(out, "w", encoding="utf-8") as handle:
        for event in iter_steps(path):
            baseline = baselines.get(event.run_id) or baselines.setdefault(
                event.run_id, NaiveBaseline()
            )
            if baseline.update(event):
                handle.write(json.dumps({"run_id": event.run_id, "step": event.step}) + "\n")
    return 0


def measure_process(steps: int, memory_steps: int, pairs: int, workdir: str, seed: int) -> dict:
    path = ensure_file(workdir, "stable", steps, seed)
    out = os.path.join(workdir, "out.jsonl")
    env = child_env(workdir)
    start_up = start_up_cpu(workdir, env)  # also the warm-up: it writes the bytecode cache
    rows = []
    run_child(limit_command(path), env)  # its own bytecode cached too
    # A B C A B C: each ratio from runs side by side (C: the backtest's limit, limit_child).
    for _ in range(pairs):
        a, peak, a_cpu = run_child(backtest_command(path, out), env)
        b, _, b_cpu = run_child(naive_command(path, out), env)
        c_cpu = run_child(limit_command(path), env)[2]
        rows.append(
            {
                "backtest_s": a,
                "naive_s": b,
                "ratio": b / a,
                "backtest_peak": peak,
                "backtest_cpu_s": a_cpu,
                "naive_cpu_s": b_cpu,
                "cpu_ratio": b_cpu / a_cpu,
                "limit_cpu_s": c_cpu,
                "over_limit": a_cpu / c_cpu,
                "limit_over_naive": b_cpu / c_cpu,
            }
        )
    backtest_s = statistics.median(r["backtest_s"] for r in rows)
    naive_s = statistics.median(r["naive_s"] for r in rows)
    memory = {steps: statistics.median(r["backtest_peak"] for r in rows)}
    if memory_steps and memory_steps != steps:
        big = ensure_file(workdir, "stable", memory_steps, seed)
        big_s, memory[memory_steps], _ = run_child(backtest_command(big, out), env)
    else:
        big_s = None
    return {
        "steps": steps,
        "pairs": rows,
        "backtest_steps_per_s": steps / backtest_s,
        "naive_steps_per_s": steps / naive_s,
        "backtest_over_naive": statistics.median(r["ratio"] for r in rows),
        "backtest_steps_per_cpu_s": steps / statistics.median(r["backtest_cpu_s"] for r in rows),
        "naive_steps_per_cpu_s": steps / statistics.median(r["naive_cpu_s"] for r in rows),
        "backtest_over_naive_cpu": statistics.median(r["cpu_ratio"] for r in rows),
        "backtest_cpu_s": statistics.median(r["backtest_cpu_s"] for r in rows),
        "start_up_cpu_s": start_up,
        # The limit run beside each pair: the backtest's CPU over it, and the best ratio to the
        # baseline it leaves (the baseline's CPU over it).
        "limit_cpu_s": statistics.median(r["limit_cpu_s"] for r in rows),
        "backtest_over_limit": statistics.median(r["over_limit"] for r in rows),
        "best_ratio_to_naive": statistics.median(r["limit_over_naive"] for r in rows),
        "peak_rss_bytes": {str(k): v for k, v in memory.items()},
        "memory_steps": memory_steps,
        "memory_run_steps_per_s": memory_steps / big_s if big_s else None,
    }


def measure_split(path: str, steps: int) -> dict:
    """In one process, CPU seconds of each part of a backtest of ``path``: what the
    whole-process figure is made of, and what the pipeline costs without the ML detector."""
    import gc

    from spikeguard.lab.backtest import SEGMENT_STEPS, offline
    from spikeguard.lab.backtest_input import iter_steps
    from spikeguard.lab.backtest_pump import DirectPipeline
    from spikeguard.settings import load_settings

    started = time.process_time()
    gc.disable()
    events = list(iter_steps(path))
    gc.enable()
    reading = time.process_time() - started
    settings = offline(load_settings(env={}))
    without_ml = settings.model_copy(
        update={
            "fusion": settings.fusion.model_copy(
                update={"expected": [n for n in settings.fusion.expected if n != "ml"]}
            )
        }
    )
    out: dict = {"steps": len(events), "read_cpu_s": reading}
    out["skip_rule_cpu_s"] = skip_rule_cpu(events)
    out["judging_cpu_s"] = judging_cpu(settings, events)
    for name, config, detectors in (
        ("all", settings, None),
        ("without_ml", without_ml, ("statistical", "rules", "predictor")),
    ):
        pipeline = DirectPipeline(config, detectors=detectors)
        spent: dict[str, float] = {}
        for stage in (*pipeline._detectors, pipeline._fusion):
            # A profiler's wrapper, set on the instance: its class's method is left alone.
            stage.handle_batch = timed_batch(stage, spent)  # type: ignore[method-assign]
        started = time.process_time()
        gc.disable()
        for i in range(0, len(events), SEGMENT_STEPS):
            pipeline.feed(events[i : i + SEGMENT_STEPS])
        pipeline.finish()
        gc.enable()
        total = time.process_time() - started
        out[name] = {
            "cpu_s": total,
            "steps_per_cpu_s": len(events) / total,
            "stages_cpu_s": spent,
            "pump_cpu_s": total - sum(spent.values()),
        }
    return out


def skip_rule_cpu(events: list) -> float:
    """CPU seconds of the Guard's skip rule replayed over ``events`` (the backtest's summary)."""
    import gc

    from spikeguard.lab.local_skips import LocalSkips

    skips = LocalSkips()
    gc.disable()
    started = time.process_time()
    for event in events:
        skips.live(event)
    spent = time.process_time() - started
    gc.enable()
    return spent


def judging_cpu(settings, events: list) -> dict[str, float]:
    """CPU seconds of the judging alone: each detector's and fusion's own objects, built as the
    pipeline builds them, fed the same steps (each run's in batches of the pump's size) with no
    stage, pump, transaction or ordering around them. What the backtest cannot go below
    without faster detectors or fusion."""
    import gc

    from spikeguard.lab.backtest_pump import BATCH, DirectPipeline
    from spikeguard.processors.detector_stage import with_values
    from spikeguard.streaming.stage import PerRunStage, group_by_run

    pipeline = DirectPipeline(settings)
    runs = group_by_run(events)
    spent: dict[str, float] = {}
    verdicts: dict[str, list[list[list]]] = {run_id: [] for run_id in runs}  # run, detector, batch
    gc.disable()
    for stage in pipeline._detectors:
        assert isinstance(stage, PerRunStage)  # a detector stage: one detector per run
        started = time.process_time()
        for run_id, steps in runs.items():
            detector = stage.factory(run_id)
            verdicts[run_id].append(
                [detector.update_many(steps[i : i + BATCH]) for i in range(0, len(steps), BATCH)]
            )
        spent[stage.name] = time.process_time() - started
    # Fusion gets each step's verdicts together, with the step's values (as the pump hands them).
    fused: dict[str, list[list]] = {}
    for run_id, steps in runs.items():
        fused[run_id] = []
        for j, i in enumerate(range(0, len(steps), BATCH)):
            chunk = steps[i : i + BATCH]
            lists = [with_values(batches[j], chunk) for batches in verdicts[run_id]]
            fused[run_id].append([v for group in zip(*lists) for v in group])
    fusion_stage = pipeline._fusion
    assert isinstance(fusion_stage, PerRunStage)  # one Fusion per run
    started = time.process_time()
    for run_id, batches in fused.items():
        fusion = fusion_stage.factory(run_id)
        for batch in batches:
            fusion.add_many(batch, 0.0)
        fusion.flush()
    spent["fusion"] = time.process_time() - started
    gc.enable()
    return spent


def timed_batch(stage, spent: dict[str, float]):
    handle = stage.handle_batch

    def handle_batch(items):
        started = time.process_time()
        try:
            return handle(items)
        finally:
            spent[stage.name] = spent.get(stage.name, 0.0) + time.process_time() - started

    return handle_batch


def render_split(split: dict) -> str:
    n = split["steps"]
    lines = [
        f"in-process split, {n:,} steps (CPU us per step):",
        f"  reading the CSV: {1e6 * split['read_cpu_s'] / n:.1f}",
    ]
    for name in ("all", "without_ml"):
        row = split[name]
        parts = ", ".join(f"{k} {1e6 * v / n:.1f}" for k, v in row["stages_cpu_s"].items())
        lines.append(
            f"  pipeline {name}: {row['steps_per_cpu_s']:,.0f} steps/CPU-s = {parts}, "
            f"pump {1e6 * row['pump_cpu_s'] / n:.1f}"
        )
    lines.append(f"  the Guard's skip rule (the summary's local skips): {skip_rule_us(split):.1f}")
    judging = split["judging_cpu_s"]
    parts = ", ".join(f"{k} {1e6 * v / n:.1f}" for k, v in judging.items())
    lines.append(
        f"  judging alone (the detectors' and fusion's own objects, no stage or pump): "
        f"{1e6 * sum(judging.values()) / n:.1f} = {parts}"
    )
    return "\n".join(lines)


def skip_rule_us(split: dict) -> float:
    return 1e6 * split["skip_rule_cpu_s"] / split["steps"]


def limit(process: dict) -> dict:
    """The backtest against its limit (``limit_child``), each run beside a pair: medians."""
    return {
        "floor_cpu_s": process["limit_cpu_s"],
        "backtest_cpu_s": process["backtest_cpu_s"],
        "backtest_over_floor": process["backtest_over_limit"],
        "best_ratio_to_naive": process["best_ratio_to_naive"],
    }


def render_limit(found: dict, process: dict) -> str:
    start = process["start_up_cpu_s"]
    return "\n".join(
        [
            f"the limit with today's detectors and fusion: {found['floor_cpu_s']:.2f} CPU-s, a "
            "process that starts as the backtest does, reads the file, replays the skip rule "
            "and judges alone (no stage or pump), run beside each pair "
            f"(start-ups on an empty file: the backtest {start['backtest']:.2f} s, the baseline "
            f"{start['naive']:.2f})",
            f"  the backtest took {found['backtest_cpu_s']:.2f} CPU-s: "
            f"{found['backtest_over_floor']:.2f}x the limit; the best ratio to the baseline the "
            f"limit allows: {found['best_ratio_to_naive']:.2f}x (aim >= "
            f"{PIPELINE_OVER_BASELINE:.0f}x)",
        ]
    )


def render_process(report: dict) -> str:
    steps = report["steps"]
    rate, ratio = report["backtest_steps_per_s"], report["backtest_over_naive"]
    lines = [
        f"whole process, stable CSV, {len(report['pairs'])} pair(s) run in turn (medians):",
        f"  backtest throughput, {steps:,} steps: {rate:,.0f} steps/s "
        f"(aim >= {PROCESS_AIM:,}) {'ok' if rate >= PROCESS_AIM else 'BELOW AIM'}",
        f"  naive baseline, same file:           {report['naive_steps_per_s']:,.0f} steps/s",
        f"  backtest / naive: {ratio:.2f}x (aim >= {PIPELINE_OVER_BASELINE:.0f}x) "
        f"{'ok' if ratio >= PIPELINE_OVER_BASELINE else 'BELOW AIM'}",
        f"  by CPU time (steadier when the machine is shared): backtest "
        f"{report['backtest_steps_per_cpu_s']:,.0f} steps/CPU-s, naive "
        f"{report['naive_steps_per_cpu_s']:,.0f}, backtest / naive "
        f"{report['backtest_over_naive_cpu']:.2f}x",
    ]
    for size, peak in report["peak_rss_bytes"].items():
        verdict = ""
        if int(size) == report["memory_steps"]:
            verdict = " (aim <= 400 MiB) " + ("ok" if peak <= MEMORY_AIM else "ABOVE AIM")
        elif not report["memory_steps"]:
            verdict = " (--memory: the 1M-step file)"
        lines.append(f"  backtest peak RSS, {int(size):,} steps: {peak / 2**20:,.0f} MiB{verdict}")
    if report["memory_run_steps_per_s"]:
        lines.append(
            f"  (the {report['memory_steps']:,}-step run: "
            f"{report['memory_run_steps_per_s']:,.0f} steps/s)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also the peak RSS of a backtest of a --memory-steps CSV",
    )
    parser.add_argument(
        "--memory-steps",
        type=int,
        default=1_000_000,
        help="the CSV whose peak RSS --memory measures",
    )
    parser.add_argument("--pairs", type=int, default=2, help="backtest/baseline pairs")
    parser.add_argument(
        "--workdir",
        default=os.path.join("/tmp", "spikeguard-bench"),
        help="where the simulated CSVs are made (once) and kept",
    )
    parser.add_argument(
        "--components",
        action="store_true",
        help="also the in-process table (pipeline, each detector, baselines)",
    )
    parser.add_argument("--scenario", default="sudden_spike", help="for --components")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--split",
        action="store_true",
        help="also the in-process split: reading, each stage, the pump; with and without ml",
    )
    parser.add_argument("--naive-child", nargs=2, metavar=("FILE", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--limit-child", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.naive_child:
        return naive_child(*args.naive_child)
    if args.limit_child:
        return limit_child(args.limit_child)
    report: dict = {"python": platform.python_version(), "machine": platform.machine()}
    report["process"] = measure_process(
        args.steps, args.memory_steps if args.memory else 0, args.pairs, args.workdir, args.seed
    )
    print(render_process(report["process"]))
    report["limit"] = limit(report["process"])
    print(render_limit(report["limit"], report["process"]))
    if args.split:
        report["split"] = measure_split(
            ensure_file(args.workdir, "stable", args.steps, args.seed), args.steps
        )
        print()
        print(render_split(report["split"]))
    if args.components:
        report["components"] = measure(args.steps, args.scenario, args.seed)
        print()
        print(render(report["components"]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
