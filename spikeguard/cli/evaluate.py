"""``spikeguard evaluate``: score the pipeline and two baselines on labelled runs.

By default the runs are the synthetic suite (every scenario x ``--seeds``;
``--scenario`` filters); ``--files`` scores labelled CSV/JSONL files instead
(files without a label column count as clean runs). ``--real-spikes [DIR]``
scores real loss curves with real spikes against the lab's labels
(``spikeguard.lab.labelling``), ``--healthy [DIR]`` real healthy runs (every
alarm there is a false one); on real curves every logged point is one step.
Without DIR they read the repository's ``data/`` (a clone has it; an installed
package does not, and says so). For each system it prints, per scenario and
overall: recall, precision (per alarm episode), F1, false alarms per 10k clean
steps, median detection delay and the predictor's median lead time; then
whether the pipeline meets the targets. Definitions: ``spikeguard.lab.evaluation``.

``--families {development,test}`` and ``--held-out`` print spikeguard (the
pipeline, the policy and the Guard's skip rule) beside the six-sigma rule
(OLMo-core) and a robust-z rule (axolotl style) on the same runs and labels
(``spikeguard.lab.side_by_side``): recall, precision, false alarms, and the
false actions per 10k steps of the healthy runs. ``--families test`` scores
the test half of the run families (odd seeds, ``spikeguard.lab.families``),
``--held-out`` the real spikes labelled by the 1.3x point rule and the
healthy runs of ``data/held-out``. See docs/evaluation.md.

``--false-actions [PATH ...]`` reports, instead of scores, what each system
would *do* to healthy runs, per kind and per 10k steps: the pipeline's stops,
rollbacks, LR cuts and skipped batches (its decisions handed to the recovery
policy) and the Guard's local skips, next to the steps each simple rule flags
(``spikeguard.lab.false_actions``). Without PATH: the repository's
``data/healthy`` runs (one kind each), ``data/modded-nanogpt`` and ``data/mlperf-bert``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from spikeguard.cli._common import add_settings_flags, settings_from, terminal_bar
from spikeguard.errors import SpikeguardError
from spikeguard.lab.baselines import BASELINES, flag_run
from spikeguard.lab.families import DEFAULT_STEPS, HALVES, case_of, seeds_of
from spikeguard.lab.families import generate as generate_family
from spikeguard.lab.evaluation import (
    EvaluationConfig,
    Mark,
    RunScore,
    marks_from_decisions,
    score_run,
    summarize,
)
from spikeguard.lab.runfile import StepLabel, read_steps
from spikeguard.lab.simulate import SCENARIOS, default_suite

if TYPE_CHECKING:
    from spikeguard.lab.side_by_side import ScoredRun

SYSTEMS = {
    "pipeline": "spikeguard pipeline (all detectors + fusion, via backtest)",
    "naive": "baseline (a): naive z-score > 2.5 / jump > 50 % / slope over the last 20 losses",
    "six_sigma": "OLMo-core: loss or grad norm > mean + 6 sd of the previous 128 values",
    "axolotl": "axolotl-style: robust z > 6 (median, 1.4826 MAD of the last 100 accepted values)",
    "metaseq": "metaseq: loss / EWM(span 9) of accepted losses > 2",
    "lightning": "Lightning SpikeDetection: loss >= 3x the mean of the last 10 accepted losses",
    "llm_foundry": "llm-foundry KillLossSpike: loss >= 2x the mean of the last 100, 5 steps running",
}
BASELINE_NAMES = [name for name in SYSTEMS if name != "pipeline"]
#: The type of a mark whose response is only to skip one update (the Guard's local skip).
OUTLIER = "outlier_step"
REAL_SPIKES, HEALTHY = "real-spikes", "healthy"
#: ``--real-spikes``/``--healthy`` given without a folder: the repository's data.
IN_REPO = ""
#: The healthy runs again, without the marks whose response is only to skip one update.
HEALTHY_INCIDENTS = "healthy, skips excluded"
OVERALL, CLEAN = "overall", "clean runs"
_MAX_FILE_ROWS = 20


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="score the pipeline and two baselines on labelled runs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2, 3],
        help="seeds of the synthetic suite (default 0 1 2 3)",
    )
    parser.add_argument(
        "--scenario",
        nargs="+",
        choices=sorted(SCENARIOS),
        metavar="NAME",
        help="only these scenarios: " + ", ".join(SCENARIOS),
    )
    parser.add_argument(
        "--files",
        nargs="+",
        metavar="FILE",
        help="labelled CSV/JSONL runs instead of the synthetic suite",
    )
    parser.add_argument(
        "--real-spikes",
        metavar="DIR",
        nargs="?",
        const=IN_REPO,
        help="real curves with labelled spikes (no DIR: the repository's data/real-spikes)",
    )
    parser.add_argument(
        "--labels",
        metavar="FILE",
        help="labels of --real-spikes (default: DIR/labels.csv, else the lab's)",
    )
    parser.add_argument(
        "--healthy",
        metavar="DIR",
        nargs="?",
        const=IN_REPO,
        help="real healthy runs (no DIR: the repository's data/modded-nanogpt)",
    )
    parser.add_argument(
        "--false-actions",
        metavar="PATH",
        nargs="*",
        help="healthy runs, by kind (a CSV or a folder per kind; none: the "
        "repository's data/healthy runs, data/modded-nanogpt, data/mlperf-bert): "
        "report each system's false actions per 10k steps instead of scores",
    )
    parser.add_argument(
        "--families",
        choices=HALVES,
        help="score spikeguard (pipeline + policy + the Guard's skips), the six-sigma and the "
        "robust-z rule on a half of the run families (spikeguard.lab.families: even seeds are "
        "the development half, odd seeds the test half); the figures that count are the test half's",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=40,
        help="--families: how many runs of the half (its first seeds; default %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help="--families: steps per run (default %(default)s)",
    )
    parser.add_argument(
        "--held-out",
        action="store_true",
        help="score spikeguard, the six-sigma and the robust-z rule on the held-out real data: "
        "the real spikes labelled by the 1.3x point rule, and data/held-out's healthy runs",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        choices=list(SYSTEMS),
        default=list(SYSTEMS),
        help="what to score (default: all)",
    )
    parser.add_argument(
        "--loss-only",
        action="store_true",
        help="drop grad_norm, lr and update_norm (as in most real logs); "
        "non-finite labels on a finite loss are dropped too",
    )
    parser.add_argument(
        "--incidents-only",
        action="store_true",
        help="drop the marks whose response is only to skip one update "
        "(type outlier_step): score what a system escalates",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when the pipeline misses a target"
    )
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def _given(path: str | None) -> str | None:
    """The folder a data-set option names; None (the loader takes the repository's) when bare."""
    return path or None


def _shown(path: str | None, in_repo: str) -> str | None:
    """A data-set option as the report names it."""
    return None if path is None else path or in_repo


def run(args: argparse.Namespace) -> int:
    real = args.real_spikes is not None or args.healthy is not None
    modes = (bool(args.files), real, args.false_actions is not None, bool(args.families))
    if sum((*modes, args.held_out)) > 1:
        print(
            "evaluate: --files, --real-spikes/--healthy, --false-actions, --families and "
            "--held-out cannot be combined",
            file=sys.stderr,
        )
        return 2
    if args.families or args.held_out:
        return side_by_side_report(args)
    if args.false_actions is not None:
        return false_actions_report(args)
    settings = settings_from(args) if any(n.startswith("pipeline") for n in args.systems) else None
    config = EvaluationConfig()
    scores: dict[str, dict[str, list[RunScore]]] = {name: {} for name in args.systems}
    seconds: Counter[str] = Counter()
    try:
        # One run at a time (the synthetic suite is generated lazily): a bad
        # or missing data set surfaces on the first run that needs it.
        total = _score(args, settings, config, scores, seconds)
    except SpikeguardError as exc:
        print(f"evaluate: {exc}", file=sys.stderr)
        return 2
    return _report(args, config, scores, seconds, total)


def _score(args, settings, config, scores, seconds) -> int:
    """Score every run of the chosen inputs into ``scores``; the number of steps."""
    total = 0
    runs = _runs(args)
    bar = run_progress(runs)
    for group, events, labels in bar if bar is not None else runs:
        if args.loss_only:
            events, labels = loss_only(events, labels)
        steps = [e.step for e in events]
        total += len(steps)
        for name in args.systems:
            started = time.perf_counter()
            marks = system_marks(name, events, settings)
            if args.incidents_only:
                marks = [m for m in marks if m.type != OUTLIER]
            seconds[name] += time.perf_counter() - started
            scores[name].setdefault(group, []).append(
                score_run(steps, labels, marks, config, group)
            )
            if group == HEALTHY:
                incidents = [m for m in marks if m.type != OUTLIER]
                scores[name].setdefault(HEALTHY_INCIDENTS, []).append(
                    score_run(steps, labels, incidents, config, HEALTHY_INCIDENTS)
                )
        if bar is not None:
            bar.set_postfix_str(f"{total:,} steps", refresh=False)
    if bar is not None:
        bar.close()
    return total


#: What each simple rule's flag does in its trainer (a false action on a healthy run).
RULE_ACTIONS = {
    "naive": "flag",
    "six_sigma": "skip",
    "axolotl": "skip",
    "metaseq": "skip",
    "lightning": "stop",
    "llm_foundry": "stop",
}
PIPELINE_COLUMNS = (
    ("stops", "stops"),
    ("rollbacks", "rollbacks"),
    ("lr_cuts", "LR cuts"),
    ("skipped_batches", "skipped batches"),
    ("local_skips", "local skips"),
)


def side_by_side_report(args: argparse.Namespace) -> int:
    """--families or --held-out: spikeguard, six-sigma and robust z on the same runs and labels."""
    from spikeguard.lab import side_by_side

    if args.families and (args.runs < 1 or args.steps < 500):
        print("evaluate: --families needs --runs >= 1 and --steps >= 500", file=sys.stderr)
        return 2
    settings = settings_from(args)
    runs: _Sized | list[ScoredRun]
    try:
        if args.families:
            runs, title = _family_runs(args), f"run families, {args.families} half"
        else:
            runs, title = _held_out_runs(), "held-out real data"
        bar = terminal_bar(runs, unit="run", desc="evaluate")
        report = side_by_side.compare(bar if bar is not None else runs, settings)
    except SpikeguardError as exc:
        print(f"evaluate: {exc}", file=sys.stderr)
        return 2
    if args.families:
        report["half"] = args.families
        report["seeds"] = seeds_of(args.families, args.runs)
    print(json.dumps(report, indent=2) if args.json else side_by_side.render(report, title))
    return 0


class _Sized:
    """A lazy sequence of known length (for the progress bar)."""

    def __init__(self, items, length: int) -> None:
        self.items, self.length = items, length

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return self.length


def _family_runs(args: argparse.Namespace) -> _Sized:
    """The first ``--runs`` runs of the chosen half, generated as they are scored."""

    from spikeguard.lab.side_by_side import ScoredRun  # imports the Guard's parts: not in a worker

    def runs():
        for seed in seeds_of(args.families, args.runs):
            run = generate_family(case_of(seed, args.steps))
            yield ScoredRun(f"{args.families} half", run.events, run.labels, run.case.family.wander)

    return _Sized(runs(), args.runs)


#: The labels of the real spikes by the point rule (spikeguard.lab.labelling.point_rule_events).
POINT_RULE_LABELS = "algoperf_submissions.point-rule.csv"
HELD_OUT_HEALTHY = ("mlperf-bert", "modded-nanogpt")


def _held_out_runs() -> list[ScoredRun]:
    """The real spikes (labels by the point rule) and the held-out healthy runs."""
    from spikeguard.lab.realdata import LABELS_DIR, data_dir, load_healthy_set, load_spike_set
    from spikeguard.lab.side_by_side import ScoredRun

    runs = [
        ScoredRun("real spikes (1.3x rule)", run.events, run.labels)
        for run in load_spike_set(None, LABELS_DIR / POINT_RULE_LABELS)
    ]
    for name in HELD_OUT_HEALTHY:
        folder = data_dir("held-out") / name
        runs += [
            ScoredRun(f"held-out/{name}", run.events, None) for run in load_healthy_set(folder)
        ]
    return runs


def false_actions_report(args: argparse.Namespace) -> int:
    """Per healthy kind: the pipeline's actions (policy and the Guard's local skips) and each
    simple rule's flags, per 10k steps. On a healthy run every one of them is false."""
    from spikeguard.lab.false_actions import pipeline_false_actions, rule_flags
    from spikeguard.lab.realdata import healthy_kinds

    settings = settings_from(args)
    rules = [name for name in args.systems if name in RULE_ACTIONS]
    try:
        kinds = healthy_kinds(args.false_actions)
    except SpikeguardError as exc:
        print(f"evaluate: {exc}", file=sys.stderr)
        return 2
    report: dict = {
        "unit": "actions per 10,000 steps",
        "rule_actions": {r: RULE_ACTIONS[r] for r in rules},
        "kinds": {},
    }
    for kind, runs in kinds.items():
        started = time.perf_counter()
        runs_events = [run.events for run in runs]
        row: dict = {"runs": len(runs), "steps": sum(map(len, runs_events))}
        if "pipeline" in args.systems:
            counts = pipeline_false_actions(runs_events, settings)
            row["pipeline"] = {**counts.per_10k(), "counts": counts._asdict()}
        for name in rules:
            flags = rule_flags(name, runs_events)
            row[name] = {
                "per_10k": flags.flagged * 10_000 / max(flags.steps, 1),
                "count": flags.flagged,
                "runs_flagged": flags.runs_flagged,
            }
        report["kinds"][kind] = row
        print(
            f"evaluate: {kind}: {row['steps']:,} steps, {time.perf_counter() - started:.1f} s",
            file=sys.stderr,
        )
    print(json.dumps(report, indent=2) if args.json else render_false_actions(report))
    return 0


def render_false_actions(report: dict) -> str:
    """One line per healthy kind: steps, the pipeline's actions, each rule's flags; per 10k steps."""
    kinds = report["kinds"]
    rules = list(report["rule_actions"])
    with_pipeline = any("pipeline" in row for row in kinds.values())
    header = ["kind", "runs", "steps"]
    if with_pipeline:
        header += [title for _, title in PIPELINE_COLUMNS]
    header += [f"{r} ({report['rule_actions'][r]})" for r in rules]
    table = [header]
    for kind, row in kinds.items():
        line = [kind, str(row["runs"]), f"{row['steps']:,}"]
        if with_pipeline:
            line += [_fmt(row["pipeline"][key], 1) for key, _ in PIPELINE_COLUMNS]
        line += [
            f"{_fmt(row[r]['per_10k'], 1)} ({row[r]['runs_flagged']}/{row['runs']})" for r in rules
        ]
        table.append(line)
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = [
        f"== false actions on healthy runs ({report['unit']}; pipeline: what the policy and the "
        "Guard's local skip rule would do; rules: steps flagged (runs flagged/runs))"
    ]
    lines += [
        "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths)))
        for r in table
    ]
    return "\n".join(lines)


def run_progress(runs):
    """A bar counting the runs scored, on a terminal only: scoring the default suite
    takes minutes, and a silent terminal looks hung."""
    return terminal_bar(runs, unit="run", desc="evaluate")


def _report(args, config, scores, seconds, total) -> int:
    """Print the report (tables or JSON); the exit code."""
    report = build_report(scores)
    timing = ", ".join(
        f"{n} {s:.1f} s ({total / max(s, 1e-9):,.0f} steps/s)" for n, s in seconds.items()
    )
    print(f"evaluate: {total:,} steps; {timing}", file=sys.stderr)
    if args.json:
        real = args.real_spikes is not None or args.healthy is not None
        report["inputs"] = {
            "files": args.files,
            "real_spikes": _shown(args.real_spikes, "data/real-spikes"),
            "labels": args.labels,
            "healthy": _shown(args.healthy, "data/modded-nanogpt"),
            "seeds": None if args.files or real else args.seeds,
            "scenarios": args.scenario,
            "loss_only": args.loss_only,
            "incidents_only": args.incidents_only,
            "steps": total,
            "config": config.model_dump(),
        }
        report["timing_seconds"] = dict(seconds)
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    failed = [t for t in report.get("targets", []) if not t["ok"]]
    return 1 if args.check and failed else 0


def system_marks(name: str, events, settings=None) -> list[Mark]:
    """One mark per step of one run, from the pipeline or a baseline."""
    if name == "pipeline":
        from spikeguard.lab.backtest import backtest_events

        return marks_from_decisions(backtest_events(events, settings))
    return flag_run(BASELINES[name](), events)


def loss_only(events, labels):
    """The run as a loss-only log would record it."""
    keep = {"grad_norm": None, "lr": None, "update_norm": None}
    stripped = [e.model_copy(update=keep) for e in events]
    if labels is not None:
        labels = [
            StepLabel(False, "") if lab.kind == "non_finite" and math.isfinite(e.loss) else lab
            for e, lab in zip(events, labels)
        ]
    return stripped, labels


def _runs(args) -> Iterator[tuple[str, list, list | None]]:
    if args.real_spikes is not None or args.healthy is not None:
        from spikeguard.lab.realdata import load_healthy_set, load_spike_set

        if args.real_spikes is not None:
            for run in load_spike_set(_given(args.real_spikes), args.labels):
                yield REAL_SPIKES, run.events, run.labels
        if args.healthy is not None:
            for run in load_healthy_set(_given(args.healthy)):
                yield HEALTHY, run.events, None
        return
    if args.files:
        by_file = len(args.files) <= _MAX_FILE_ROWS
        for path in args.files:
            events, labels = read_steps(path)
            group = Path(path).stem if by_file else "files"
            runs: dict[str, list[int]] = {}  # a file may hold several runs: score each alone
            for i, event in enumerate(events):
                runs.setdefault(event.run_id, []).append(i)
            for index in runs.values():
                yield group, [events[i] for i in index], labels and [labels[i] for i in index]
        return
    for item in default_suite(args.seeds, args.scenario):
        labelled = item.generate()
        yield item.scenario, labelled.events, labelled.labels


def build_report(scores: dict[str, dict[str, list[RunScore]]]) -> dict:
    """Per system: a summary per group, of the clean runs, and overall; then the targets."""
    report: dict = {"systems": {}}
    for name, groups in scores.items():
        rows = {group: summarize(runs).as_dict() for group, runs in groups.items()}
        every = [
            score for group, runs in groups.items() if group != HEALTHY_INCIDENTS for score in runs
        ]
        clean = [score for score in every if not score.episodes]
        if clean and len(clean) < len(every):
            rows[CLEAN] = summarize(clean).as_dict()
        rows[OVERALL] = summarize(every).as_dict()
        report["systems"][name] = {"title": SYSTEMS[name], "rows": rows}
    if "pipeline" in scores:
        report["targets"] = targets(report["systems"])
    return report


def targets(systems: dict) -> list[dict]:
    """The project's detection targets for the pipeline, each with whether it is met.

    Recall and precision apply only when there are labelled episodes. "F1 above a baseline" also holds when
    both are perfect (1.0), as nothing can be above that.
    """
    rows = systems["pipeline"]["rows"]
    overall = rows[OVERALL]
    kinds = overall["by_kind"]
    checks = []

    def check(name: str, value, ok: bool) -> None:
        checks.append({"target": name, "value": value, "ok": bool(ok)})

    if overall["episodes"]:  # (clean runs alone: only the false-alarm target applies)
        check("recall >= 0.95 overall", overall["recall"], overall["recall"] >= 0.95)
        precision = overall["precision"]
        check("precision >= 0.9 overall", precision, (precision or 0) >= 0.9)
    if "non_finite" in kinds:
        value = kinds["non_finite"]["recall"]
        check("recall = 1.0 on non_finite (same step)", value, value == 1.0)
    clean = rows.get(CLEAN, overall)
    fa = clean["false_alarms_per_10k"]
    check("false alarms <= 0.5 per 10k steps of clean runs", fa, fa is not None and fa <= 0.5)
    for kind in ("sudden_spike", "grad_explosion"):
        if kind in kinds:
            delay = kinds[kind]["median_delay"]
            check(f"median delay <= 1 step ({kind})", delay, delay is not None and delay <= 1)
    for baseline in BASELINE_NAMES:
        if baseline not in systems:
            continue
        theirs = systems[baseline]["rows"]
        worse = [
            group
            for group, row in rows.items()
            if group != CLEAN
            and theirs.get(group, {}).get("f1") is not None
            and (row["f1"] is None or row["f1"] <= theirs[group]["f1"])
            and not row["f1"] == theirs[group]["f1"] == 1.0
        ]
        check(f"F1 above {baseline} on every scenario and overall", worse or "all", not worse)
    others = [systems[b]["rows"] for b in BASELINE_NAMES if b in systems]
    if REAL_SPIKES in rows and others:  # the real-data bar: beat every baseline
        best = max((r[REAL_SPIKES]["recall"] or 0) for r in others)
        mine = rows[REAL_SPIKES]["recall"] or 0
        check(f"recall on {REAL_SPIKES} above every baseline (best {best:.3f})", mine, mine > best)
    if HEALTHY in rows and others:
        best = min(r[HEALTHY]["false_alarms_per_10k"] for r in others)
        mine = rows[HEALTHY_INCIDENTS]["false_alarms_per_10k"]
        check(
            f"false alarms per 10k on {HEALTHY} <= the best baseline ({best:.2f})",
            mine,
            mine <= best,
        )
    return checks


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


COLUMNS = (
    ("runs", "runs", 0),
    ("steps", "steps", 0),
    ("episodes", "episodes", 0),
    ("recall", "recall", 3),
    ("precision", "precision", 3),
    ("f1", "F1", 3),
    ("false_alarms_per_10k", "FA/10k clean", 2),
    ("median_delay", "med delay", 1),
    ("median_lead", "med lead", 1),
    ("false_warnings_per_10k", "warn-for-nothing/10k", 2),
)


COMPARE = (
    ("recall", "recall", 3),
    ("precision", "precision", 3),
    ("f1", "F1", 3),
    ("false_alarms_per_10k", "FA/10k clean", 2),
    ("median_delay", "med delay", 1),
)


def comparison(report: dict) -> str:
    """One line per group and system: the headline numbers side by side, delay per kind."""
    table = [
        ["set", "system"] + [title for _, title, _ in COMPARE] + ["recall (median delay) by kind"]
    ]
    groups = list(next(iter(report["systems"].values()))["rows"])
    if REAL_SPIKES in groups or HEALTHY in groups:  # different sets: their sum means nothing
        groups = [g for g in groups if g not in (CLEAN, OVERALL)]
    for group in groups:
        for name, system in report["systems"].items():
            row = system["rows"].get(group)
            if row is None:
                continue
            kinds = "; ".join(
                f"{k} {v['detected']}/{v['episodes']} ({_fmt(v['median_delay'], 0)})"
                for k, v in row["by_kind"].items()
            )
            table.append([group, name] + [_fmt(row[key], d) for key, _, d in COMPARE] + [kinds])
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["== comparison"]
    for r in table:
        lines.append(
            "  ".join(
                c.ljust(w) if j in (0, 1, len(r) - 1) else c.rjust(w)
                for j, (c, w) in enumerate(zip(r, widths))
            ).rstrip()
        )
    return "\n".join(lines)


def render(report: dict) -> str:
    """Aligned text tables, one per system, then the side-by-side comparison and the targets."""
    out: list[str] = []
    for name, system in report["systems"].items():
        rows = system["rows"]
        width = max(len("scenario"), *map(len, rows))
        table = [["scenario"] + [title for _, title, _ in COLUMNS]]
        for group, row in rows.items():
            table.append([group] + [_fmt(row[key], d) for key, _, d in COLUMNS])
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        widths[0] = width
        out.append(f"\n== {name}: {system['title']}")
        for i, r in enumerate(table):
            if i and r[0] in (CLEAN, OVERALL) and table[i - 1][0] not in (CLEAN, OVERALL):
                out.append("-" * (sum(widths) + 2 * len(widths)))
            out.append(
                "  ".join(
                    c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))
                )
            )
        kinds = rows[OVERALL]["by_kind"]
        if kinds:
            parts = [
                f"{k} {v['detected']}/{v['episodes']} (delay {_fmt(v['median_delay'], 1)})"
                for k, v in kinds.items()
            ]
            out.append("recall by kind: " + "; ".join(parts))
    out.append("\n" + comparison(report))
    if "targets" in report:
        out.append("\n== targets (pipeline)")
        for t in report["targets"]:
            value = t["value"] if isinstance(t["value"], (str, list)) else _fmt(t["value"], 3)
            out.append(f"  [{'ok' if t['ok'] else 'MISS'}] {t['target']}: {value}")
    return "\n".join(out)
