"""What each detector adds: the detectors + fusion with all of them, then with each one removed.

``python -m spikeguard.lab.ablation [--seeds 0 1] [--real-spikes DIR] [--healthy DIR]
[--layer-seeds 0 1 2]`` prints one row per configuration and set: episodes
detected, recall, precision, F1, false alarm episodes and false alarms per 10k
clean steps (incidents: ``outlier_step`` marks are the guard's skips and are
counted apart, as ``skips/10k``) and the median delay; then, per detector and
set, what it adds: the incidents it alone detects, the false incident alarms it
alone raises, and the guard-skip marks per 10k with and without it. The
detectors run in-process with default settings and fusion expecting exactly the
detectors kept (a removed detector is not waited for), as the worker would with
that detector switched off.

Sets: ``synthetic`` (the simulator's default suite), ``real-spikes`` (real
loss curves with labelled events), ``healthy`` (real healthy runs: every alarm
is false) and ``layer-blowup`` / ``layer-healthy`` (small real torch models
with per-layer gradient norms, one layer blown up or none, see
:mod:`spikeguard.lab.layer_runs`): the only set that carries per-layer norms.

Each detector judges a run once; the configurations differ only in which
verdicts fusion gets (a detector never sees another's verdicts), so that is
the same as running the pipeline five times.
"""

from __future__ import annotations

import argparse
from typing import Callable, Iterable, Iterator, Sequence

from spikeguard.lab.evaluation import Mark, marks_from_decisions, score_run, summarize
from spikeguard.processors.detectors import CONFIGS, DETECTORS, Detector
from spikeguard.processors.fusion import Fusion
from spikeguard.processors.fusion_config import FusionConfig
from spikeguard.schemas import StepEvent, Verdict

ALL = ("statistical", "rules", "ml", "predictor")
OUTLIER = "outlier_step"


def verdicts_of(events: list[StepEvent], names: Iterable[str]) -> dict[str, list[Verdict]]:
    """Each named detector's verdicts on one run (default settings)."""
    return {n: _detector(n).update_many(events) for n in names}


def _detector(name: str) -> Detector:
    build: Callable[..., Detector] = DETECTORS[name]  # each detector class takes its config
    return build(CONFIGS[name]())


def fuse(run_id: str, verdicts: dict[str, list[Verdict]], names: Sequence[str]) -> list[Mark]:
    """One mark per step from the named detectors' verdicts and fusion expecting exactly them."""
    fusion = Fusion(FusionConfig(expected=list(names)), run_id=run_id)
    columns = [verdicts[n] for n in names]
    out = []
    for i in range(len(columns[0])):
        for per_detector in columns:
            out += fusion.add(per_detector[i], 0.0)
    return marks_from_decisions(out + fusion.flush())


def decide(events: list[StepEvent], names: Iterable[str]) -> list[Mark]:
    """One mark per step of one run, from the named detectors and fusion."""
    names = list(names)
    return fuse(events[0].run_id, verdicts_of(events, names), names)


def configurations() -> Iterator[tuple[str, tuple[str, ...]]]:
    yield "all", ALL
    for name in ALL:
        yield f"-{name}", tuple(n for n in ALL if n != name)


def ablate(runs: list[tuple[str, list[StepEvent], list | None]]) -> list[dict]:
    """Rows of (configuration, set, metrics) for ``runs`` = (set name, events, labels or None)."""
    judged = [(group, events, labels, verdicts_of(events, ALL)) for group, events, labels in runs]
    rows = []
    for config, names in configurations():
        scores: dict[str, list] = {}
        skips: dict[str, list] = {}
        for group, events, labels, verdicts in judged:
            steps = [e.step for e in events]
            marks = fuse(events[0].run_id, verdicts, names)
            scores.setdefault(group, []).append(score_run(steps, labels, marks))
            skips.setdefault(group, []).append(
                score_run(steps, labels, [m for m in marks if m.type == OUTLIER])
            )
            scores.setdefault(group + " (incidents)", []).append(
                score_run(steps, labels, [m for m in marks if m.type != OUTLIER])
            )
        for group, group_scores in scores.items():
            s = summarize(group_scores)
            base = group.removesuffix(" (incidents)")
            rows.append(
                {
                    "config": config,
                    "set": group,
                    "episodes": s.episodes,
                    "detected": s.detected,
                    "recall": s.recall,
                    "precision": s.precision,
                    "f1": s.f1,
                    "false_alarms": s.false_alarm_episodes,
                    "fa_per_10k": s.false_alarms_per_10k,
                    "skips_per_10k": summarize(skips[base]).false_alarms_per_10k,
                    "median_delay": s.median_delay,
                }
            )
    return rows


def contributions(rows: list[dict]) -> list[dict]:
    """Per detector and set: the incidents it alone detects, the false incident alarms it alone
    raises (``outlier_step`` skips apart), and the guard-skip marks per 10k with and without it."""
    incidents = {
        (r["config"], r["set"].removesuffix(" (incidents)")): r
        for r in rows
        if r["set"].endswith(" (incidents)")
    }
    marks = {(r["config"], r["set"]): r for r in rows if not r["set"].endswith(" (incidents)")}
    out = []
    for (config, group), r in incidents.items():
        if config == "all":
            continue
        a = incidents["all", group]
        out.append(
            {
                "detector": config[1:],
                "set": group,
                "adds_detections": a["detected"] - r["detected"],
                "adds_false_alarms": a["false_alarms"] - r["false_alarms"],
                "f1_without": r["f1"],
                "f1_with": a["f1"],
                "skips_without": marks[config, group]["skips_per_10k"],
                "skips_with": marks["all", group]["skips_per_10k"],
            }
        )
    return out


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def _table(rows: list[dict], cols: tuple[str, ...]) -> None:
    print("  ".join(f"{c:>24}" if c == "set" else f"{c:>13}" for c in cols))
    for row in rows:
        print(
            "  ".join(f"{_fmt(row[c]):>24}" if c == "set" else f"{_fmt(row[c]):>13}" for c in cols)
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spikeguard.lab.ablation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="*",
        default=[0, 1],
        help="seeds of the synthetic suite (none: skip it)",
    )
    parser.add_argument("--real-spikes", metavar="DIR", help="real curves with labelled spikes")
    parser.add_argument("--healthy", metavar="DIR", help="real healthy runs")
    parser.add_argument(
        "--layer-seeds",
        type=int,
        nargs="*",
        default=[],
        help="seeds of the real torch runs with per-layer norms (4 runs a seed, "
        "~5 s each on one core)",
    )
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
    if args.layer_seeds:
        from spikeguard.lab.layer_runs import layer_set

        runs += [
            (group, r.events, r.labels if r.layer else None)
            for group, r in layer_set(tuple(args.layer_seeds))
        ]
    rows = ablate(runs)
    _table(
        rows,
        (
            "config",
            "set",
            "episodes",
            "detected",
            "recall",
            "precision",
            "f1",
            "false_alarms",
            "fa_per_10k",
            "skips_per_10k",
            "median_delay",
        ),
    )
    print("\nwhat each detector adds (incidents; all detectors vs all but it; skips per 10k):")
    _table(
        contributions(rows),
        (
            "detector",
            "set",
            "adds_detections",
            "adds_false_alarms",
            "f1_without",
            "f1_with",
            "skips_without",
            "skips_with",
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
