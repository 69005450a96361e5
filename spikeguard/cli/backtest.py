"""``spikeguard backtest FILE --out OUT.jsonl``: judge a recorded run offline.

FILE is CSV (header with at least ``step,loss``; optional ``grad_norm,lr,run_id``;
``nan``/``inf`` allowed) or JSONL of step events. The whole pipeline (all
detectors + fusion) runs as on the embedded bus, batch for batch, but with no
bus between the stages, deterministically; OUT gets one
JSON decision per line: every anomalous or preventive decision (``--all``: every step).
The file is read and judged as a stream, so memory does not grow with its size;
on a terminal a progress bar follows the file (none when stderr is not a TTY).

The summary also gives the updates the live Guard would have skipped on its own
(its local skip rule, default settings, one rule per run: what the trainer does at
once, before the pipeline hears of the step) and, for steps recorded from a live
run, the skips the file records (``skip_reason``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from spikeguard.cli._common import add_settings_flags, settings_from, terminal_bar
from spikeguard.errors import SpikeguardError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "backtest",
        help="run all detectors + fusion over a CSV/JSONL of steps",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", help="CSV (step,loss[,grad_norm,lr,run_id]) or JSONL of StepEvents")
    parser.add_argument(
        "--out", required=True, help="where to write decisions (JSONL); - for stdout"
    )
    parser.add_argument("--all", action="store_true", help="write healthy decisions too")
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def check_out(source: str, out: str) -> None:
    """Refuse, before any work, an output that cannot be written or would destroy the input."""
    if out == "-":
        return
    target, origin = Path(out), Path(source)
    if not target.parent.is_dir():
        raise SpikeguardError(f"--out {out}: directory {target.parent} does not exist")
    if target.is_dir():
        raise SpikeguardError(f"--out {out} is a directory; give a file name")
    same = target.exists() and origin.exists() and os.path.samefile(origin, target)
    if same or target.resolve() == origin.resolve():
        raise SpikeguardError(f"--out {out} is the input file {source}; it would be overwritten")


def progress_bar(path: str):
    """A bar over the file's size on a terminal; None (no output at all) otherwise."""
    try:
        size = os.path.getsize(path)
    except OSError:
        size = None
    return terminal_bar(total=size, unit="B", unit_scale=True, unit_divisor=1024, desc="backtest")


def run(args: argparse.Namespace) -> int:
    from spikeguard.lab.backtest import backtest_stream
    from spikeguard.lab.backtest_input import iter_steps
    from spikeguard.lab.local_skips import LocalSkips

    check_out(args.file, args.out)
    settings = settings_from(args)
    bar = progress_bar(args.file)
    steps = 0
    skips = LocalSkips()

    def counted():
        nonlocal steps
        for event in iter_steps(args.file, on_progress=bar.update if bar else None):
            steps += 1
            yield skips.live(event)  # as the live Guard publishes it: its own skips said

    # Decisions are written as they come, to OUT.part, renamed to OUT once the
    # whole file is judged: a file broken half-way leaves no half output behind.
    partial = None if args.out == "-" else Path(args.out + ".part")
    started = time.perf_counter()
    written = anomalies = 0
    incidents: set[str] = set()
    out = sys.stdout if partial is None else partial.open("w", encoding="utf-8")
    try:
        for decision in backtest_stream(counted(), settings):
            anomalies += decision.is_anomaly
            if decision.incident_id:
                incidents.add(decision.incident_id)
            if args.all or decision.is_anomaly or decision.preventive:
                out.write(decision.model_dump_json() + "\n")
                written += 1
    except BaseException:
        if partial is not None:
            out.close()
            partial.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    if partial is not None:
        out.close()
        os.replace(partial, args.out)
    elapsed = time.perf_counter() - started
    print(
        f"backtest: {steps} steps, {anomalies} anomalous decisions, {len(incidents)} incidents, "
        f"{written} lines -> {args.out} ({steps / max(elapsed, 1e-9):,.0f} steps/s); {skips.summary()}",
        file=sys.stderr,
    )
    return 0
