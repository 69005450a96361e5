"""Backtest throughput on one generated run: the pipeline, each detector, the baselines.

    python benchmarks/bench_backtest.py [--steps 100000] [--scenario sudden_spike]
                                        [--seed 0] [--json results.json]

Everything runs in this one process on one thread (OMP/MKL/torch pinned), one
after the other on the same events, so the numbers compare. "pipeline" is
``backtest_events`` (all detectors + fusion on the embedded bus); each
detector runs alone through ``update_many`` in batches of 500; the baselines
through ``update``. Aims (issue 3): pipeline >= 20k steps/s and >= 4x the
naive baseline; statistical, rules, predictor >= 50k steps/s; ml >= 20k.
A benchmark, not a test: it reports, it does not fail.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy / torch load their thread pools

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Callable  # noqa: E402

BATCH = 500
AIMS = {"pipeline": 20_000, "statistical": 50_000, "rules": 50_000, "predictor": 50_000, "ml": 20_000}
PIPELINE_OVER_BASELINE = 4.0


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

        names = [n for n in ("statistical", "rules", "ml", "predictor") if n in DETECTORS]
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
        lines.append(f"\npipeline / naive baseline: {ratio:.2f}x (aim >= "
                     f"{report['pipeline_over_naive_aim']:.0f}x)  {verdict}")
    if report["missing_detectors"]:
        lines.append(f"not measured (missing): {', '.join(report['missing_detectors'])}")
    return "\n".join(lines)


def _k(aim: int | None) -> str:
    return "-" if aim is None else f">={aim // 1000}k"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--scenario", default="sudden_spike")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    report = measure(args.steps, args.scenario, args.seed)
    print(render(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
