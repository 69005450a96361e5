"""Recovery benchmark: spikeguard against the anchors' recovery strategies on a small transformer, over seeds.

    python benchmarks/bench_recovery.py [--quick | --tiny] [--seeds N] [--seed FIRST] [--jobs J]
                                        [--device cpu|cuda] [--json]
                                        [--faults bad_shard,...] [--strategies none,...]
                                        [--details runs.json]

One character-level decoder-only transformer (recovery_setup.py) trained on
standard-library source, once clean and then once per (fault, strategy), for
each of N seeds; a seed fixes the weights, the batches and the fault, so the
strategies of one seed are paired (they meet the same run). The faults are in
recovery_faults.py, the strategies in recovery_baselines.py and
recovery_guarded.py, the cost and goodput bookkeeping in recovery_ledger.py.
``--quick`` (5 seeds, 2 processes) takes about 10 minutes on 2 quiet cores
(about 7 with ``--jobs 3``; docs/benchmarks.md); the default is the full
configuration; ``--device cuda`` runs a ~50M parameter model
(recovery_setup.CUDA) on a GPU.

Reported per fault and strategy: the mean final eval loss over the seeds and
its 95 % interval (Student t), the mean wasted steps and goodput. With
``--json`` the last line printed is ``{"clean": MEAN, "clean_ci95": [LO, HI],
"seeds": [...], "results": [{"fault", "strategy", "final_eval_loss" (mean),
"ci95", "wasted_steps" (mean, rounded), "rollbacks" (mean, rounded),
"goodput" (mean), "actions" (state-changing actions applied, spikeguard only),
"per_seed": [losses]}, ...]}``; a non-finite loss is the string "NaN" or
"Infinity" (the project's JSON convention), and a mean over seeds with a
non-finite one is non-finite.

Aims: on every fault spikeguard's mean is the best, or the best is within the
95 % interval of the paired difference (spikeguard minus the best, seed by
seed); within 2 % of clean wherever any strategy is; no state-changing action
on the healthy run; fewer wasted steps than palm_manual where both act. The
last lines say where it does not. A benchmark, not a test: it reports, it does
not fail.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before torch loads its thread pools

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the recovery_* helpers next to this file

import torch  # noqa: E402

from recovery_baselines import (  # noqa: E402
    BASELINES,
    RESTART_ONLY,
    SamePath,
    never_fires,
    run_baseline,
)
from recovery_faults import FAULTS, Fault  # noqa: E402
from recovery_guarded import open_bench_runtime, run_spikeguard  # noqa: E402
from recovery_setup import CUDA, FULL, QUICK, TINY, BenchConfig, build  # noqa: E402

STRATEGIES = BASELINES + ("spikeguard",)
WITHIN_CLEAN = 0.02
# Two-sided 95 % Student t quantiles by degrees of freedom (scipy is not a dependency).
T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    15: 2.131,
    20: 2.086,
    30: 2.042,
}
CHANGING = (
    "rollback",
    "skip_batches",
    "scale_lr",
    "set_lr",
    "restore_lr",
    "clip",
    "stop",
    "set_eps",
    "reduce_batch_size",
)
_runtime = None  # one embedded pipeline per process, opened on its first spikeguard run


def run_one(fault: str, strategy: str, cfg: BenchConfig, seed: int) -> dict:
    global _runtime
    torch.set_num_threads(1)
    problem = build(seed, cfg, fault)
    f = Fault(fault, cfg, seed)
    if strategy == "spikeguard":
        if _runtime is None:
            _runtime = open_bench_runtime()
        # (the trainer opts in to the mechanism signals: docs/instability.md)
        result = run_spikeguard(problem, f, cfg, seed, _runtime, signals=True)
    else:
        result = run_baseline(problem, f, strategy, cfg, seed)
    result["seed"] = seed
    return result


def _close_runtime() -> None:
    if _runtime is not None:
        _runtime.close()


def t95(n: int) -> float:
    df = max(1, n - 1)
    return T95.get(df) or T95[max(k for k in T95 if k <= df)]


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95 % interval; non-finite if any value is."""
    n = len(values)
    mean = sum(values) / n
    if not math.isfinite(mean) or n < 2:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t95(n) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def aggregate(runs: list[dict], seeds: list[int]) -> list[dict]:
    """One row per (fault, strategy), in the order first met."""
    order: list[tuple[str, str]] = []  # (fault, strategy)
    by: dict[tuple[str, str], dict[int, dict]] = {}  # -> seed -> that run
    for r in runs:
        key = (r["fault"], r["strategy"])
        if key not in by:
            order.append(key)
            by[key] = {}
        by[key][r["seed"]] = r
    rows = []
    for key in order:
        per = [by[key][s] for s in seeds if s in by[key]]
        losses = [r["final_eval_loss"] for r in per]
        mean, lo, hi = mean_ci(losses)
        n = len(per)
        actions = sum(
            sum(
                1
                for e in r["events"]
                if e.startswith("action at") and any(f": {k} applied" in e for k in CHANGING)
            )
            for r in per
        )
        rows.append(
            {
                "fault": key[0],
                "strategy": key[1],
                "final_eval_loss": mean,
                "ci95": [lo, hi],
                "wasted_steps": round(sum(r["wasted_steps"] for r in per) / n),
                "rollbacks": round(sum(r["rollbacks"] for r in per) / n),
                "goodput": round(sum(r["goodput"] for r in per) / n, 4),
                "rerun_steps": round(sum(r["rerun_steps"] for r in per) / n, 1),
                "skipped_updates": round(sum(r["skipped_updates"] for r in per) / n, 1),
                "skipped_batches": round(sum(r["skipped_batches"] for r in per) / n, 1),
                "recovery_seconds": round(sum(r["recovery_seconds"] for r in per) / n, 2),
                "steps_done": min(r["steps_done"] for r in per),
                "actions": actions,
                "per_seed": losses,
                "responses": sorted(
                    {
                        e.split("[", 1)[1].split("]", 1)[0]
                        for r in per
                        for e in r["events"]
                        if e.startswith("policy at") and "[" in e
                    }
                ),
            }
        )
    return rows


def verdicts(clean: float, rows: list[dict]) -> dict[str, str]:
    """Per fault: does spikeguard meet the aims? ("ok", or what it misses)."""
    out = {}
    for fault in dict.fromkeys(r["fault"] for r in rows):
        mine = {r["strategy"]: r for r in rows if r["fault"] == fault}
        guard = mine.get("spikeguard")
        if guard is None:
            continue
        loss, misses = guard["final_eval_loss"], []
        finite = {s: r for s, r in mine.items() if math.isfinite(r["final_eval_loss"])}
        best_name = min(finite, key=lambda s: finite[s]["final_eval_loss"]) if finite else None
        if best_name is not None and best_name != "spikeguard":
            pairs = [g - b for g, b in zip(guard["per_seed"], finite[best_name]["per_seed"])]
            _, lo, _ = mean_ci(pairs)
            if not (math.isfinite(lo) and lo <= 0.0):
                misses.append(f"worse than {best_name} beyond the 95% interval")
        near = [s for s, r in finite.items() if r["final_eval_loss"] <= clean * (1 + WITHIN_CLEAN)]
        if near and not (math.isfinite(loss) and loss <= clean * (1 + WITHIN_CLEAN)):
            misses.append(f"not within 2% of clean ({', '.join(near)} are)")
        if fault == "healthy" and guard["actions"]:
            misses.append(f"{guard['actions']} state-changing actions on a healthy run")
        # A strategy acted where it wasted more than doing nothing did (a GradScaler's own
        # overflow skips cost every strategy the same).
        palm, floor = mine.get("palm_manual"), mine.get("none", {}).get("wasted_steps", 0)
        if (
            palm is not None
            and palm["wasted_steps"] > floor
            and guard["wasted_steps"] > floor
            and not guard["wasted_steps"] < palm["wasted_steps"]
        ):
            misses.append("wastes no fewer steps than palm_manual")
        out[fault] = "ok" if not misses else "; ".join(misses)
    return out


def table(
    clean: tuple[float, float, float], rows: list[dict], budget: int, seeds: list[int]
) -> str:
    marks = verdicts(clean[0], rows)
    lines = [
        f"clean eval loss {clean[0]:.4f} [{clean[1]:.4f}, {clean[2]:.4f}] over seeds {seeds}",
        "",
        "| fault | strategy | final eval loss (mean) | 95% interval | vs clean | wasted steps | goodput "
        "| re-run | skipped updates | skipped batches | rollbacks | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        loss = r["final_eval_loss"]
        rel = f"{100 * (loss / clean[0] - 1):+.1f}%" if math.isfinite(loss) else "diverged"
        ci = f"[{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}]" if math.isfinite(loss) else "-"
        note = f"stopped at step {r['steps_done']}" if r["steps_done"] < budget else ""
        if r["responses"]:
            note = (note + " " if note else "") + "responses: " + ", ".join(r["responses"])
        lines.append(
            f"| {r['fault']} | {r['strategy']} | {loss:.4f} | {ci} | {rel} | {r['wasted_steps']} "
            f"| {r['goodput']:.3f} | {r['rerun_steps']:g} | {r['skipped_updates']:g} "
            f"| {r['skipped_batches']:g} | {r['rollbacks']} | {note} |"
        )
    lines += [""] + [f"spikeguard on {f}: {v}" for f, v in marks.items()]
    return "\n".join(lines)


# Actions after which a replayed data path is not the guarded run any more (its LR, clipping
# or optimizer differ), so the replay says what the path costs, not that the runs are one.
NOT_DATA_PATH = tuple(k for k in CHANGING if k not in ("rollback", "skip_batches"))


def same_path_runs(runs: list[dict], cfg: BenchConfig) -> list[dict]:
    """Each spikeguard run that rolled back or skipped, beside the plain loop replaying its data
    path (recovery_baselines.SamePath) and the none run of its fault and seed."""
    none = {(r["fault"], r["seed"]): r for r in runs if r["strategy"] == "none"}
    out = []
    for r in runs:
        path = r.get("path")
        if r["strategy"] != "spikeguard" or not path:
            continue
        if not path["rollbacks"] and not path["skipped_updates"]:
            continue
        torch.set_num_threads(1)
        fault = Fault(r["fault"], cfg, r["seed"])
        replay = run_baseline(
            build(r["seed"], cfg, r["fault"]), fault, "same_path", cfg, r["seed"], SamePath(path)
        )
        other = [
            e.split(": ")[1].split(" ")[0]
            for e in r["events"]
            if e.startswith("action at") and any(f": {k} applied" in e for k in NOT_DATA_PATH)
        ]
        base = none.get((r["fault"], r["seed"]))
        out.append(
            {
                "fault": r["fault"],
                "seed": r["seed"],
                "spikeguard": r["final_eval_loss"],
                "same_path": replay["final_eval_loss"],
                "none": base["final_eval_loss"] if base else math.nan,
                "rollbacks": len([e for e in path["rollbacks"] if e["to"] is not None]),
                "skipped_batches": r["skipped_batches"],
                "skipped_updates": len(path["skipped_updates"]),
                "also_applied": sorted(set(other)),
            }
        )
    return out


def same_path_table(rows: list[dict]) -> str:
    lines = [
        "Same data path, no judgement (--same-path): the plain loop replaying each guarded run's "
        "rollbacks, skip windows and skipped updates",
        "",
        "| fault | seed | spikeguard | same path | none | path vs none | rollbacks "
        "| skipped batches | skipped updates | also applied (not replayed) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = (
            f"{100 * (r['same_path'] / r['none'] - 1):+.2f}%"
            if math.isfinite(r["same_path"]) and math.isfinite(r["none"])
            else "-"
        )
        lines.append(
            f"| {r['fault']} | {r['seed']} | {r['spikeguard']:.4f} | {r['same_path']:.4f} "
            f"| {r['none']:.4f} | {rel} | {r['rollbacks']} | {r['skipped_batches']} "
            f"| {r['skipped_updates']} | {', '.join(r['also_applied']) or 'nothing'} |"
        )
    return "\n".join(lines)


def _json_float(value: float):
    return (
        value
        if math.isfinite(value)
        else ("NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity"))
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick", action="store_true", help="the smaller configuration (~10 min on 2 quiet cores)"
    )
    size.add_argument(
        "--tiny", action="store_true", help="a seconds-long configuration (the test's)"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds per (fault, strategy), paired (default 5; 1 with --tiny)",
    )
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes (default: 2, or 1 with --tiny); each opens its own pipeline",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the ~50M-parameter configuration on a GPU",
    )
    parser.add_argument(
        "--faults", default=",".join(FAULTS), help="comma-separated subset of the faults"
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument(
        "--json", action="store_true", help="print the results as one JSON line, last"
    )
    parser.add_argument(
        "--details", type=Path, help="write every run with its events (decisions, actions)"
    )
    parser.add_argument(
        "--same-path",
        action="store_true",
        help="also replay each spikeguard run that rolled back or skipped in the plain loop, "
        "with the same rollbacks, skip windows and skipped updates and no judgement: what "
        "that data path costs by itself",
    )
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    strategies = [s for s in args.strategies.split(",") if s]
    for name, known in ((faults, FAULTS), (strategies, STRATEGIES)):
        unknown = sorted(set(name) - set(known))
        if unknown:
            parser.error(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
        cfg = CUDA
    else:
        cfg = TINY if args.tiny else QUICK if args.quick else FULL
    n_seeds = args.seeds if args.seeds is not None else (1 if args.tiny else 5)
    if n_seeds < 1:
        parser.error("--seeds must be at least 1")
    seeds = list(range(args.seed, args.seed + n_seeds))
    jobs = args.jobs if args.jobs is not None else (1 if args.tiny or args.device == "cuda" else 2)
    tasks = [("clean", "none", s) for s in seeds] + [
        (f, strategy, s) for s in seeds for f in faults for strategy in strategies
    ]
    started = time.monotonic()
    runs = _run_all(tasks, cfg, jobs)
    clean_runs = [r for r in runs if r["fault"] == "clean"]
    clean = mean_ci([r["final_eval_loss"] for r in clean_runs])
    rows = aggregate([r for r in runs if r["fault"] != "clean"], seeds)
    key = {(f, s): i for i, (f, s) in enumerate((f, s) for f in faults for s in strategies)}
    rows.sort(key=lambda r: key[(r["fault"], r["strategy"])])
    print(table(clean, rows, cfg.steps, seeds))
    print(
        f"\n{len(runs)} runs in {time.monotonic() - started:.0f} s ({jobs} processes)", flush=True
    )
    if args.same_path:
        print("\n" + same_path_table(same_path_runs(runs, cfg)), flush=True)
    if args.details:
        args.details.write_text(
            json.dumps(
                {"config": cfg.__dict__, "clean": clean, "runs": runs}, indent=1, default=str
            )
        )
    if args.json:
        out_rows = []
        for r in rows:
            out_rows.append(
                {
                    "fault": r["fault"],
                    "strategy": r["strategy"],
                    "final_eval_loss": _json_float(r["final_eval_loss"]),
                    "ci95": [_json_float(v) for v in r["ci95"]],
                    "wasted_steps": r["wasted_steps"],
                    "rollbacks": r["rollbacks"],
                    "goodput": r["goodput"],
                    "actions": r["actions"],
                    "per_seed": [_json_float(v) for v in r["per_seed"]],
                }
            )
        print(
            json.dumps(
                {
                    "clean": _json_float(clean[0]),
                    "clean_ci95": [_json_float(clean[1]), _json_float(clean[2])],
                    "seeds": seeds,
                    "results": out_rows,
                }
            ),
            flush=True,
        )
    return 0


def _replayed(task: tuple[str, str, int], none: dict, cfg: BenchConfig) -> dict | None:
    """The run of a restart-only strategy whose rule never fires on the none run of the same
    fault and seed: that run, renamed (None: the rule fires, so the run must be trained)."""
    if not never_fires(task[1], cfg, none["trace"]):
        return None
    return {
        **none,
        "strategy": task[1],
        "seconds": 0.0,
        "events": [*none["events"], "never fired on the none run's trace: that run, exactly"],
    }


def _run_all(tasks: list[tuple[str, str, int]], cfg: BenchConfig, jobs: int) -> list[dict]:
    """Every task's result. A restart-only strategy (RESTART_ONLY) waits for the none run of its
    fault and seed, and is trained only if its rule fires on that run's trace."""

    def say(r: dict) -> None:
        print(
            f"seed {r['seed']} {r['fault']:12s} {r['strategy']:16s} eval {r['final_eval_loss']:.4f} "
            f"wasted {r['wasted_steps']:4d} rollbacks {r['rollbacks']} ({r['seconds']} s)",
            file=sys.stderr,
            flush=True,
        )

    has_none = {(f, s) for f, strategy, s in tasks if strategy == "none"}
    waiting: dict[tuple[str, int], list[tuple[str, str, int]]] = {}
    first: list[tuple[str, str, int]] = []
    for t in tasks:
        if t[1] in RESTART_ONLY and (t[0], t[2]) in has_none:
            waiting.setdefault((t[0], t[2]), []).append(t)
        else:
            first.append(t)
    out: list[dict] = []

    def done(r: dict, later: Callable[[tuple[str, str, int]], None]) -> None:
        out.append(r)
        say(r)
        if r["strategy"] != "none":
            return
        for t in waiting.pop((r["fault"], r["seed"]), []):
            replayed = _replayed(t, r, cfg)
            if replayed is None:
                later(t)
            else:
                out.append(replayed)
                say(replayed)

    if jobs <= 1:
        queue = list(first)
        try:
            while queue:
                t = queue.pop(0)
                done(run_one(t[0], t[1], cfg, t[2]), queue.append)
        finally:
            _close_runtime()
    else:
        import atexit
        import multiprocessing
        from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

        context = multiprocessing.get_context(
            "spawn"
        )  # a fresh interpreter: no forked torch or bus threads
        with ProcessPoolExecutor(
            jobs, mp_context=context, initializer=atexit.register, initargs=(_close_runtime,)
        ) as pool:
            pending = {pool.submit(run_one, t[0], t[1], cfg, t[2]) for t in first}

            def submit(t: tuple[str, str, int]) -> None:
                pending.add(pool.submit(run_one, t[0], t[1], cfg, t[2]))

            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    pending.discard(fut)
                    done(fut.result(), submit)
    for r in out:
        r.pop("trace", None)
    order = {t: i for i, t in enumerate(tasks)}
    return sorted(out, key=lambda r: order[(r["fault"], r["strategy"], r["seed"])])


if __name__ == "__main__":
    sys.exit(main())
