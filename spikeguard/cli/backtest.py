"""``spikeguard backtest FILE --out OUT.jsonl``: judge a recorded run offline.

FILE is CSV (header with at least ``step,loss``; optional ``grad_norm,lr,run_id``;
``nan``/``inf`` allowed) or JSONL of step events. The whole pipeline (all
detectors + fusion) runs on the embedded bus, deterministically; OUT gets one
JSON decision per line: every anomalous or preventive decision (``--all``: every step).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from spikeguard.cli._common import add_settings_flags, settings_from


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "backtest",
        help="run all detectors + fusion over a CSV/JSONL of steps",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", help="CSV (step,loss[,grad_norm,lr,run_id]) or JSONL of StepEvents")
    parser.add_argument("--out", required=True, help="where to write decisions (JSONL); - for stdout")
    parser.add_argument("--all", action="store_true", help="write healthy decisions too")
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spikeguard.lab.backtest import backtest_events
    from spikeguard.lab.runfile import read_steps

    settings = settings_from(args)
    events, _labels = read_steps(args.file)
    started = time.perf_counter()
    decisions = backtest_events(events, settings)
    elapsed = time.perf_counter() - started
    out = sys.stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")
    written = 0
    try:
        for decision in decisions:
            if args.all or decision.is_anomaly or decision.preventive:
                out.write(decision.model_dump_json() + "\n")
                written += 1
    finally:
        if out is not sys.stdout:
            out.close()
    anomalies = sum(d.is_anomaly for d in decisions)
    incidents = len({d.incident_id for d in decisions if d.incident_id})
    print(
        f"backtest: {len(events)} steps, {anomalies} anomalous decisions, {incidents} incidents, "
        f"{written} lines -> {args.out} ({len(events) / max(elapsed, 1e-9):,.0f} steps/s)",
        file=sys.stderr,
    )
    return 0
