"""What each detector adds: the detectors + fusion with all of them, then with each one removed.

``python -m spikeguard.lab.ablation [--seeds 0 1] [--real-spikes DIR] [--healthy DIR]``
prints one row per configuration and set: recall, precision, F1, false alarms
per 10k clean steps (incidents: ``outlier_step`` marks are the guard's skips and
are counted apart, as ``skips/10k``) and the median delay. The detectors run
in-process with default settings and fusion expecting exactly the detectors
kept (a removed detector is not waited for), as the worker would with that
detector switched off.
"""

from __future__ import annotations

import argparse
from typing import Iterable, Iterator

from spikeguard.lab.evaluation import Mark, marks_from_decisions, score_run, summarize
from spikeguard.processors.detectors import CONFIGS, DETECTORS
from spikeguard.processors.fusion import Fusion, FusionConfig
from spikeguard.schemas import StepEvent

ALL = ("statistical", "rules", "ml", "predictor")
OUTLIER = "outlier_step"


def decide(events: list[StepEvent], names: Iterable[str]) -> list[Mark]:
    """One mark per step of one run, from the named detectors and fusion."""
    names = list(names)
    detectors = [DETECTORS[n](CONFIGS[n]()) for n in names]
    fusion = Fusion(FusionConfig(expected=names), run_id=events[0].run_id)
    verdicts = [d.update_many(events) for d in detectors]
    out = []
    for i in range(len(events)):
        for per_detector in verdicts:
            out += fusion.add(per_detector[i], 0.0)
    return marks_from_decisions(out + fusion.flush())


def configurations() -> Iterator[tuple[str, tuple[str, ...]]]:
    yield "all", ALL
    for name in ALL:
        yield f"-{name}", tuple(n for n in ALL if n != name)


def ablate(runs: list[tuple[str, list[StepEvent], list | None]]) -> list[dict]:
    """Rows of (configuration, set, metrics) for ``runs`` = (set name, events, labels or None)."""
    rows = []
    for config, names in configurations():
        scores: dict[str, list] = {}
        skips: dict[str, list] = {}
        for group, events, labels in runs:
            steps = [e.step for e in events]
            marks = decide(events, names)
            scores.setdefault(group, []).append(score_run(steps, labels, marks))
            skips.setdefault(group, []).append(
                score_run(steps, labels, [m for m in marks if m.type == OUTLIER]))
            scores.setdefault(group + " (incidents)", []).append(
                score_run(steps, labels, [m for m in marks if m.type != OUTLIER]))
        for group, group_scores in scores.items():
            s = summarize(group_scores)
            base = group.removesuffix(" (incidents)")
            rows.append({"config": config, "set": group, "recall": s.recall, "precision": s.precision,
                         "f1": s.f1, "fa_per_10k": s.false_alarms_per_10k,
                         "skips_per_10k": summarize(skips[base]).false_alarms_per_10k,
                         "median_delay": s.median_delay})
    return rows


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spikeguard.lab.ablation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1],
                        help="seeds of the synthetic suite (none: skip it)")
    parser.add_argument("--real-spikes", metavar="DIR", help="real curves with labelled spikes")
    parser.add_argument("--healthy", metavar="DIR", help="real healthy runs")
    args = parser.parse_args(argv)
    runs: list[tuple[str, list[StepEvent], list | None]] = []
    if args.seeds:
        from spikeguard.lab.simulate import default_suite

        for item in default_suite(tuple(args.seeds)):
            run = item.generate()
            runs.append(("synthetic", run.events, run.labels))
    if args.real_spikes or args.healthy:
        from spikeguard.lab.realdata import load_healthy_set, load_spike_set

        if args.real_spikes:
            runs += [("real-spikes", r.events, r.labels) for r in load_spike_set(args.real_spikes)]
        if args.healthy:
            runs += [("healthy", r.events, None) for r in load_healthy_set(args.healthy)]
    cols = ("config", "set", "recall", "precision", "f1", "fa_per_10k", "skips_per_10k", "median_delay")
    print("  ".join(f"{c:>24}" if c == "set" else f"{c:>12}" for c in cols))
    for row in ablate(runs):
        print("  ".join(f"{_fmt(row[c]):>24}" if c == "set" else f"{_fmt(row[c]):>12}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
