"""``spikeguard simulate SCENARIO --steps N --seed S --out FILE.csv``: a labelled synthetic run.

The CSV has columns step,loss,grad_norm,lr,run_id,label,kind (then
update_norm when recorded, and time); ``label`` is 1 inside an anomaly
episode, ``kind`` names the anomaly or benign event ("" when clean).
``--list`` shows the scenarios; ``--suite DIR`` writes the default
evaluation suite (every scenario x ``--seeds``) as one CSV per run.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from spikeguard.lab.runfile import write_csv
from spikeguard.lab.simulate import SCENARIOS, LabelledRun, default_suite, generate


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="generate a labelled synthetic training run (CSV)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "scenario",
        nargs="?",
        choices=sorted(SCENARIOS),
        metavar="SCENARIO",
        help="one of: " + ", ".join(SCENARIOS),
    )
    parser.add_argument("--steps", type=int, default=5000, help="run length (default 5000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--run-id", help="run id (default sim-SCENARIO-sSEED-nSTEPS)")
    parser.add_argument("--out", default="-", help="CSV file to write; - for stdout (default)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--suite", metavar="DIR", help="write the default suite to DIR instead")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0, 1, 2, 3],
        help="seeds of the suite (default 0 1 2 3)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.list:
        width = max(map(len, SCENARIOS))
        for name, text in SCENARIOS.items():
            print(f"{name:<{width}}  {text}")
        return 0
    if args.suite:
        folder = Path(args.suite)
        folder.mkdir(parents=True, exist_ok=True)
        total = 0
        for item in default_suite(args.seeds):
            labelled = item.generate()
            path = folder / f"{labelled.run_id}.csv"
            write_csv(path, labelled.events, labelled.labels)
            total += item.steps
        print(f"simulate: wrote the suite ({total} steps) to {folder}", file=sys.stderr)
        return 0
    if not args.scenario:
        raise SystemExit("spikeguard simulate: give a SCENARIO (see --list) or --suite DIR")
    try:
        labelled = generate(args.scenario, args.steps, args.seed, run_id=args.run_id)
    except ValueError as exc:
        raise SystemExit(f"spikeguard simulate: {exc}") from None
    if args.out == "-":
        write_csv(sys.stdout, labelled.events, labelled.labels)
    else:
        write_csv(args.out, labelled.events, labelled.labels)
    print(f"simulate: {describe(labelled)} -> {args.out}", file=sys.stderr)
    return 0


def describe(labelled: LabelledRun) -> str:
    """One line: the run, its episodes by kind and its benign events."""
    episodes: Counter[str] = Counter()
    benign: Counter[str] = Counter()
    previous = None
    for lab in labelled.labels:
        key = lab.kind if lab.label else None
        if key and key != previous:
            episodes[key] += 1
        if not lab.label and lab.kind and lab.kind != previous:
            benign[lab.kind] += 1
        previous = lab.kind if lab.kind else None
    parts = ", ".join(f"{k} x{v}" for k, v in sorted(episodes.items())) or "no anomaly"
    extra = ", ".join(f"{k} x{v}" for k, v in sorted(benign.items()))
    return f"{labelled.run_id}: {len(labelled.events)} steps, {parts}" + (
        f"; {extra}" if extra else ""
    )
