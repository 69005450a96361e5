"""``spikeguard inspect INCIDENT_FILE --setup MODULE:FUNCTION``: which samples caused an incident.

The Guard writes one file per incident (``incidents/<incident>.json`` in its
checkpoint directory) with the sample ids of the batches in the incident's
window and the checkpoint taken before the onset. ``inspect`` replays each of
those samples alone through that checkpoint and ranks them by their own loss
and gradient norm; it writes the top offenders to ``--out`` as JSON and HTML,
with a ``skip_ids`` list ready for a skip list. ``--setup`` names a function
of yours that returns ``spikeguard.forensics.inspect.InspectSetup`` (model,
dataset, collate, per-sample loss): spikeguard cannot build your model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TOP = 20  # (the forensics modules import torch: only when the command runs, never in a worker)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect", help="rank the samples behind an incident", description=__doc__
    )
    parser.add_argument("incident", help="an incident file the Guard wrote (incidents/*.json)")
    parser.add_argument(
        "--setup",
        required=True,
        metavar="MODULE:FUNCTION",
        help="returns an InspectSetup (model, dataset, collate, loss_fn)",
    )
    parser.add_argument(
        "--out",
        help="where to write the JSON and HTML (default: beside the incident "
        "file, where spikeguard report --incidents finds them)",
    )
    parser.add_argument(
        "--top", type=int, default=TOP, help=f"how many samples to list (default {TOP})"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from spikeguard.forensics.inspect import inspect_incident, load_setup
    from spikeguard.forensics.record import IncidentBatches

    out = args.out or str(Path(args.incident).parent)
    report = inspect_incident(
        IncidentBatches.read(args.incident), load_setup(args.setup), out, args.top
    )
    if args.json:
        print(json.dumps(report, default=str))
        return 0
    print(
        f"incident {report['incident_id']} of run {report['run_id']} (onset step {report['onset_step']}): "
        f"{report['samples']} samples replayed through the checkpoint of step {report['checkpoint_step']}"
    )
    for i, row in enumerate(report["top"][:10], 1):
        print(
            f"  {i:2d}. sample {row['sample_id']} (step {row['step']}): score {row['score']}, "
            f"loss {row['loss']:.4g} (z {row['loss_z']}), grad norm {row['grad_norm']:.4g} (z {row['grad_z']})"
        )
    print(f"skip list: {report['skip_ids']}; written to {out}")
    return 0
