"""The ``ml`` detector alone: steps/s through ``update_many`` in batches of 500, and its fit.

    python benchmarks/bench_ml.py [--steps 50000] [--trials 3] [--against REV]

Rows (each detector fresh per trial, on the same events, one thread):

- ``plain``: a simulated ``stable`` run (loss, grad norm, LR; no per-layer norms):
  the rolling features, the isolation forest's batched walk and its refits;
- ``layers``: the same run with eight per-layer norms a step (top 5 reported),
  which adds the layer-share model.

``--against REV`` loads ``processors/detectors/ml.py`` as it was at git revision
REV (``fc5ab08``: before issue 16's work on it) and runs it interleaved with the
current one, trial by trial, so that the ratio is taken within one run on a
shared machine. The fit row times one forest fit on 1024 rows: sklearn's
``IsolationForest`` + compile against :func:`fit_forest`. A benchmark: it
reports, it does not fail.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy loads its thread pool

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

BATCH = 500


def with_layers(events: list, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    base = np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.03, 0.02])
    out = []
    for e in events:
        sq = base * np.exp(0.3 * rng.standard_normal(len(base))) * (e.grad_norm or 1.0) ** 2
        norms = np.sqrt(sq)
        top = {f"layer{j}": float(norms[j]) for j in np.argsort(-norms)[:5]}
        out.append(e.model_copy(update={"grad_norm": float(np.sqrt(sq.sum())), "top_grad_norms": top}))
    return out


def load_at(rev: str):
    """The MLDetector class of ml.py at git revision ``rev``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "-C", root, "show", f"{rev}:processors/detectors/ml.py"],
                            check=True, capture_output=True, text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"ml_at_{rev}", f.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # pydantic resolves the module's annotations through it
    spec.loader.exec_module(module)
    return module.MLDetector


def rate(cls, events: list) -> float:
    detector = cls()
    started = time.perf_counter()
    for i in range(0, len(events), BATCH):
        detector.update_many(events[i : i + BATCH])
    return len(events) / (time.perf_counter() - started)


def fit_times(trials: int) -> dict[str, float]:
    import sklearn
    from sklearn.ensemble import IsolationForest

    from spikeguard.processors.detectors.ml_forest import CompiledForest, fit_forest

    rows = np.round(np.random.default_rng(0).normal(size=(1024, 5)), 4)
    out: dict[str, list[float]] = {"sklearn": [], "fit_forest": []}
    for i in range(trials * 3):
        started = time.perf_counter()
        with sklearn.config_context(assume_finite=True, skip_parameter_validation=True):
            CompiledForest(IsolationForest(n_estimators=50, max_samples=256, random_state=i).fit(rows))
        out["sklearn"].append(time.perf_counter() - started)
        started = time.perf_counter()
        fit_forest(rows, 50, 256, i)
        out["fit_forest"].append(time.perf_counter() - started)
    return {k: statistics.median(v) * 1000 for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--against", metavar="REV", help="git revision of ml.py to compare with")
    args = parser.parse_args(argv)
    from spikeguard.lab.simulate import generate
    from spikeguard.processors.detectors.ml import MLDetector

    plain = generate("stable", args.steps, 0).events
    sets = {"plain": plain, "layers": with_layers(plain)}
    classes = {"now": MLDetector}
    if args.against:
        classes = {args.against: load_at(args.against), **classes}
    print(f"ml detector alone, {args.steps} steps, batches of {BATCH}, median of {args.trials} trials")
    for name, events in sets.items():
        rates: dict[str, list[float]] = {k: [] for k in classes}
        for _ in range(args.trials):
            for label, cls in classes.items():
                rates[label].append(rate(cls, events))
        med = {k: statistics.median(v) for k, v in rates.items()}
        line = "  ".join(f"{k}: {v:,.0f} steps/s" for k, v in med.items())
        if args.against:
            line += f"  ratio now/{args.against}: " + "/".join(
                f"{n / o:.2f}" for n, o in zip(rates["now"], rates[args.against]))
        print(f"{name:>7}  {line}")
    fits = fit_times(args.trials)
    print(f"    fit  IsolationForest+compile {fits['sklearn']:.0f} ms, "
          f"fit_forest {fits['fit_forest']:.0f} ms "
          f"({fits['sklearn'] / fits['fit_forest']:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
