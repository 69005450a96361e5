"""``spikeguard demo``: train a small model, inject a fault, watch the guard recover.

A character-level MLP language model learns the source of a standard-library
module (no downloads). ``--fault`` injects trouble at step 100: ``spike``
(corrupted batches), ``nan`` (poisoned batches), ``divergence`` (a learning-rate
blow-up), ``poison`` (three garbage samples in the dataset: ``spikeguard inspect``
finds them from the incident record kept in ``--forensics``), ``flaky`` (a
one-off device fault: the Guard re-runs the step, finds it transient, skips it
without a rollback). The whole pipeline runs on the embedded bus (Kafka when
SPIKEGUARD_BOOTSTRAP_SERVERS is set); ``--no-guard`` trains the same thing
unprotected. ``--plot`` writes the run's report: a PNG of the loss and
gradient norm marking anomalies, incidents, actions and rollbacks, re-run
steps in green, and an HTML page beside it (see ``spikeguard report``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spikeguard.settings import Settings

# Kept here, not imported: importing spikeguard.producers loads torch, and
# building the CLI parser (every command's --help) must stay cheap.
# tests/spikeguard/demo/test_demo_cli.py checks they match spikeguard.demo.model.
FAULTS = ("none", "spike", "nan", "divergence", "poison", "flaky")
DEFAULT_STEPS = 300


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a small model through an injected fault",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--fault", choices=FAULTS, default="spike", help="what goes wrong (default: spike)"
    )
    parser.add_argument("--seed", type=int, default=0, help="one seed, one result (default 0)")
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default {DEFAULT_STEPS})"
    )
    parser.add_argument("--no-guard", action="store_true", help="train unprotected")
    parser.add_argument("--json", action="store_true", help="print the outcome as one JSON object")
    parser.add_argument(
        "--plot",
        default="spikeguard-demo.png",
        metavar="PNG",
        help="report image, and PNG-name.html beside it (default spikeguard-demo.png; '' for none)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--forensics",
        default="spikeguard-demo-forensics",
        metavar="DIR",
        help="keep the incident records (sample ids, pre-onset checkpoint) here for "
        "spikeguard inspect (default spikeguard-demo-forensics; '' for none)",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="settings file (TOML, or YAML with pyyaml); default: $SPIKEGUARD_CONFIG. "
        "Its values, and SPIKEGUARD_* variables, win over the demo's tuned policy",
    )
    parser.set_defaults(func=run)


def demo_settings(config_file: str | None = None) -> "Settings":
    """The demo's tuned policy, except where the config file or a SPIKEGUARD_* variable says otherwise.

    The tuned values are the demo's defaults, not flags: a user who sets
    ``policy.skip_extra_batches`` in a file means it to apply.
    """
    from spikeguard.demo.run import DEMO_SETTINGS
    from spikeguard.settings import load_settings, load_settings_with_origins

    _, given = load_settings_with_origins(config_file=config_file)
    return load_settings(
        {k: v for k, v in DEMO_SETTINGS.items() if k not in given}, config_file=config_file
    )


class _ProgressBar:
    """One line on stderr, redrawn in place; a log line meanwhile starts on a line of its own."""

    def __init__(self) -> None:
        self.open = False  # the cursor is at the end of the bar

    def __call__(self, step: int, total: int, loss: float) -> None:
        if step % 5 and step < total:
            return
        width = 30
        done = min(width, int(width * step / max(total, 1)))
        sys.stderr.write(
            f"\r[{'#' * done}{'.' * (width - done)}] step {step:4d}/{total}  loss {loss:8.3f}"
        )
        self.open = step < total
        if not self.open:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def filter(self, record: logging.LogRecord) -> bool:
        """A logging filter: end the bar's line before the Guard's WARNING lines are printed."""
        if self.open:
            sys.stderr.write("\n")
            self.open = False
        return True


def run(args: argparse.Namespace) -> int:
    from spikeguard.demo.model import DemoSetup
    from spikeguard.demo.run import run_demo

    if args.steps < 150:
        raise SystemExit(
            "spikeguard demo: --steps must be at least 150 (the fault strikes at step 100)"
        )
    setup = DemoSetup(steps=args.steps)
    progress = None if (args.quiet or args.json) else _ProgressBar()
    if progress is not None:
        for handler in logging.getLogger().handlers:
            handler.addFilter(progress)
    runtime = None
    if not args.no_guard:
        # Opened here rather than by run_demo, so that the report can read the run back
        # and the settings honour --config.
        from spikeguard.runtime import open_runtime

        runtime = open_runtime(demo_settings(args.config))
    try:
        outcome = run_demo(
            args.fault,
            seed=args.seed,
            guarded=not args.no_guard,
            setup=setup,
            progress=progress,
            runtime=runtime,
            keep_incidents=args.forensics or None,
        )
        page = None
        if args.plot:
            from spikeguard.demo.plot import report_outcome

            page = report_outcome(outcome, args.plot, runtime)
    finally:
        if runtime is not None:
            runtime.close()
    summary = outcome.summary()
    if args.json:
        print(json.dumps(summary))
        return 0
    loss = outcome.final_eval_loss
    print(f"fault: {args.fault}   guard: {'off' if args.no_guard else 'on'}   seed: {args.seed}")
    print(
        f"final evaluation loss: {loss:.4f}"
        if math.isfinite(loss)
        else f"final evaluation loss: {loss}"
    )
    print(
        f"steps: {outcome.steps}   incidents: {outcome.incidents}   rollbacks: {outcome.rollbacks}   "
        f"skipped batches: {outcome.skipped_batches}   skipped updates: {outcome.skipped_updates}"
    )
    if outcome.detections:
        first = outcome.detections[0]
        kinds = sorted({t for _, _, t in outcome.detections})
        print(
            f"detected: {len(outcome.detections)} anomalous steps from step {first[0]} ({', '.join(kinds)})"
        )
    for a in outcome.actions:
        print(
            f"  step {a['step']:4d} (epoch {a['epoch']})  {a['kind']:<14} {a['status']:<9} {a['result']}"
        )
    if outcome.transient_steps:
        print(
            f"re-run steps found transient (suspect the device; skipped, no rollback): "
            f"{outcome.transient_steps}"
        )
    for path in outcome.incident_files:
        print(
            f"incident record: {path}\n  which samples? spikeguard inspect {path} "
            f"--setup spikeguard.demo.model:inspect_setup"
        )
    if args.plot:
        print(f"report: {args.plot} and {page}")
    return 0
