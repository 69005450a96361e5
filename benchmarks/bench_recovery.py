"""Recovery benchmark: spikeguard against the anchors' recovery strategies on a small transformer.

    python benchmarks/bench_recovery.py [--quick] [--json] [--seed 0]
                                        [--faults bad_shard,...] [--strategies none,...]
                                        [--details runs.json]

One character-level decoder-only transformer (recovery_setup.py) trained on
CPU on standard-library source, once clean and then once per (fault,
strategy) with the same seed, weights, batches and faults (recovery_faults.py);
the strategies are in recovery_baselines.py and recovery_guarded.py, the cost
bookkeeping in recovery_ledger.py. ``--quick`` is the smaller configuration
(under 12 minutes on 2 cores); the default is the full one.

With ``--json`` the last line printed is
``{"clean": LOSS, "results": [{"fault", "strategy", "final_eval_loss",
"wasted_steps", "rollbacks"}, ...]}``; a non-finite loss is written as the
string "NaN" or "Infinity" (the project's JSON convention). Aims:
for every fault spikeguard ends within 2 % of clean, no worse than the best
other strategy (0.5 % slack), and wastes fewer steps than palm_manual; the
table's last column says where it does not. A benchmark, not a test: it
reports, it does not fail.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the recovery_* helpers next to this file

import torch  # noqa: E402

from recovery_baselines import BASELINES, run_baseline  # noqa: E402
from recovery_faults import FAULTS, Fault  # noqa: E402
from recovery_guarded import open_bench_runtime, run_spikeguard  # noqa: E402
from recovery_setup import FULL, QUICK, TINY, BenchConfig, build  # noqa: E402

STRATEGIES = BASELINES + ("spikeguard",)
WITHIN_CLEAN, SLACK = 0.02, 0.005


def run_one(fault: str, strategy: str, cfg: BenchConfig, seed: int, runtime) -> dict:
    problem = build(seed, cfg, fault)
    f = Fault(fault, cfg, seed)
    if strategy == "spikeguard":
        return run_spikeguard(problem, f, cfg, seed, runtime)
    return run_baseline(problem, f, strategy, cfg, seed)


def verdicts(clean: float, results: list[dict]) -> dict[str, str]:
    """Per fault: does spikeguard meet the aims? ("ok", or what it misses)."""
    out = {}
    for fault in {r["fault"] for r in results}:
        rows = {r["strategy"]: r for r in results if r["fault"] == fault}
        guard = rows.get("spikeguard")
        if guard is None:
            continue
        loss, misses = guard["final_eval_loss"], []
        if not (math.isfinite(loss) and loss <= clean * (1 + WITHIN_CLEAN)):
            misses.append("not within 2% of clean")
        others = [r["final_eval_loss"] for s, r in rows.items() if s != "spikeguard"
                  and math.isfinite(r["final_eval_loss"])]
        if others and not (math.isfinite(loss) and loss <= min(others) * (1 + SLACK)):
            misses.append("worse than the best other")
        if "palm_manual" in rows and not guard["wasted_steps"] < rows["palm_manual"]["wasted_steps"]:
            misses.append("wastes no fewer steps than palm_manual")
        out[fault] = "ok" if not misses else "; ".join(misses)
    return out


def table(clean: float, results: list[dict], budget: int) -> str:
    marks = verdicts(clean, results)
    lines = [f"clean eval loss {clean:.4f}", "",
             "| fault | strategy | final eval loss | vs clean | wasted steps | rollbacks | note |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        loss = r["final_eval_loss"]
        rel = f"{100 * (loss / clean - 1):+.1f}%" if math.isfinite(loss) else "diverged"
        note = f"stopped at step {r['steps_done']}" if r["steps_done"] < budget else ""
        lines.append(f"| {r['fault']} | {r['strategy']} | {loss:.4f} | {rel} | {r['wasted_steps']} "
                     f"| {r['rollbacks']} | {note} |")
    lines += [""] + [f"spikeguard on {f}: {v}" for f, v in sorted(marks.items())]
    return "\n".join(lines)


def _json_float(value: float):
    return value if math.isfinite(value) else ("NaN" if math.isnan(value) else
                                               ("Infinity" if value > 0 else "-Infinity"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the smaller configuration (< 12 min on 2 cores)")
    size.add_argument("--tiny", action="store_true", help="a seconds-long configuration (the test's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", default=",".join(FAULTS), help="comma-separated subset of the faults")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line, last")
    parser.add_argument("--details", type=Path, help="write every run with its events (decisions, actions)")
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    strategies = [s for s in args.strategies.split(",") if s]
    for name, known in ((faults, FAULTS), (strategies, STRATEGIES)):
        unknown = sorted(set(name) - set(known))
        if unknown:
            parser.error(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    cfg = TINY if args.tiny else QUICK if args.quick else FULL
    torch.set_num_threads(1)
    started = time.monotonic()
    runtime = open_bench_runtime() if "spikeguard" in strategies else None
    try:
        clean_run = run_one("clean", "none", cfg, args.seed, None)
        clean = clean_run["final_eval_loss"]
        print(f"clean: eval loss {clean:.4f} ({clean_run['seconds']} s)", file=sys.stderr, flush=True)
        results = []
        for fault in faults:
            for strategy in strategies:
                r = run_one(fault, strategy, cfg, args.seed, runtime)
                results.append(r)
                print(f"{fault:12s} {strategy:16s} eval {r['final_eval_loss']:.4f} wasted {r['wasted_steps']:4d} "
                      f"rollbacks {r['rollbacks']} ({r['seconds']} s)", file=sys.stderr, flush=True)
    finally:
        if runtime is not None:
            runtime.close()
    print(table(clean, results, cfg.steps))
    print(f"\n{len(results) + 1} runs in {time.monotonic() - started:.0f} s", flush=True)
    if args.details:
        args.details.write_text(json.dumps({"config": cfg.__dict__, "clean": clean, "runs": results},
                                           indent=1, default=str))
    if args.json:
        keys = ("fault", "strategy", "final_eval_loss", "wasted_steps", "rollbacks")
        rows = [{k: (_json_float(r[k]) if k == "final_eval_loss" else r[k]) for k in keys} for r in results]
        print(json.dumps({"clean": _json_float(clean), "results": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
