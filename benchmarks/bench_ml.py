"""The ``ml`` detector alone: steps/s through ``update_many`` in batches of 500, and its fit.

    python benchmarks/bench_ml.py [--steps 50000] [--trials 3] [--against REV]

Rows (each detector fresh per trial, on the same events, one thread):

- ``plain``: a simulated ``stable`` run (loss, grad norm, LR; no per-layer norms):
  the rolling features, the isolation forest's batched walk and its refits;
- ``layers``: the same run with eight per-layer norms a step (top 5 reported),
  which adds the layer-share model;
- ``fit``: one forest fit on 1024 rows: sklearn's ``IsolationForest`` + compile
  against :func:`fit_forest` (and fit_forest at REV with ``--against``).

Rates are steps per second of the process's CPU time (``wall`` beside it): on a
machine shared with other work the CPU time drifts far less than the wall time.
``--against REV`` runs the same trials on the whole package as it was at git
revision REV (exported with ``git archive`` and imported in a child process),
interleaved trial by trial with the working tree's, so that the ratio is taken
within one run. A benchmark: it reports, it does not fail.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy loads its thread pool

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

BATCH = 500
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pyproject.toml's [tool.setuptools.package-dir]: the top-level folders under one import name.
PACKAGE_DIRS = {
    "spikeguard": "spikeguard",
    "spikeguard/schemas": "schemas",
    "spikeguard/producers": "producers",
    "spikeguard/processors": "processors",
    "spikeguard/actuators": "actuators",
}


def with_layers(events: list, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    base = np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.03, 0.02])
    out = []
    for e in events:
        sq = base * np.exp(0.3 * rng.standard_normal(len(base))) * (e.grad_norm or 1.0) ** 2
        norms = np.sqrt(sq)
        top = {f"layer{j}": float(norms[j]) for j in np.argsort(-norms)[:5]}
        out.append(
            e.model_copy(update={"grad_norm": float(np.sqrt(sq.sum())), "top_grad_norms": top})
        )
    return out


def export(rev: str, into: str) -> str:
    """The package as it was at ``rev``, laid out to import as ``spikeguard``; its root."""
    src, root = os.path.join(into, "src"), os.path.join(into, "root")
    os.makedirs(src)
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    for target, folder in PACKAGE_DIRS.items():
        shutil.copytree(os.path.join(src, folder), os.path.join(root, target), dirs_exist_ok=True)
    return root


def one_trial(steps: int) -> dict[str, float]:
    """One trial of every row, in this process (whichever package it imports)."""
    from spikeguard.lab.simulate import generate
    from spikeguard.processors.detectors.ml import MLDetector
    from spikeguard.processors.detectors.ml.forest import fit_forest

    plain = generate("stable", steps, 0).events
    out: dict[str, float] = {}
    for name, events in (("plain", plain), ("layers", with_layers(plain))):
        detector = MLDetector()
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(0, len(events), BATCH):
            detector.update_many(events[i : i + BATCH])
        out[name] = len(events) / (time.process_time() - cpu)
        out[name + "_wall"] = len(events) / (time.perf_counter() - wall)
    rows = np.round(np.random.default_rng(0).normal(size=(1024, 5)), 4)
    fits = []
    for i in range(3):
        cpu = time.process_time()
        fit_forest(rows, 50, 256, i)
        fits.append(time.process_time() - cpu)
    out["fit_forest_ms"] = statistics.median(fits) * 1000
    return out


def sklearn_fit_ms(trials: int) -> float:
    import sklearn
    from sklearn.ensemble import IsolationForest

    from spikeguard.processors.detectors.ml.forest import CompiledForest

    rows = np.round(np.random.default_rng(0).normal(size=(1024, 5)), 4)
    times = []
    for i in range(trials * 3):
        cpu = time.process_time()
        with sklearn.config_context(assume_finite=True, skip_parameter_validation=True):
            CompiledForest(
                IsolationForest(n_estimators=50, max_samples=256, random_state=i).fit(rows)
            )
        times.append(time.process_time() - cpu)
    return statistics.median(times) * 1000


def child(steps: int, pythonpath: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath  # ahead of the editable install of the working tree
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--one", "--steps", str(steps)],
        env=env,
        cwd=pythonpath or ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--against", metavar="REV", help="git revision to compare with")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one trial
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_trial(args.steps)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        trees: dict[str, str | None] = {"now": None}
        if args.against:
            trees = {args.against: export(args.against, tmp), "now": None}
        results: dict[str, list[dict[str, float]]] = {label: [] for label in trees}
        for _ in range(args.trials):  # interleaved: both see the same machine
            for label, path in trees.items():
                results[label].append(child(args.steps, path))
    print(
        f"ml detector alone, {args.steps} steps, batches of {BATCH}, median of {args.trials} "
        "trials, steps per CPU second (wall)"
    )
    for row in ("plain", "layers"):
        med = {k: statistics.median(r[row] for r in v) for k, v in results.items()}
        wall = {k: statistics.median(r[row + "_wall"] for r in v) for k, v in results.items()}
        line = "  ".join(f"{k}: {med[k]:,.0f} ({wall[k]:,.0f})" for k in results)
        if args.against:
            line += f"  now/{args.against}: {med['now'] / med[args.against]:.2f}x"
        print(f"{row:>7}  {line}")
    fits = {k: statistics.median(r["fit_forest_ms"] for r in v) for k, v in results.items()}
    print(
        f"    fit  IsolationForest+compile {sklearn_fit_ms(args.trials):.1f} ms, fit_forest "
        + ", ".join(f"{k}: {v:.1f} ms" for k, v in fits.items())
        + " (CPU, 1024 rows, 50 trees)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
