"""``spikeguard presets [NAME] [--json]``: print the model profiles (small, medium, large)."""

from __future__ import annotations

import argparse
import json

from spikeguard.actuators.presets import PRESETS, get_preset

# The policy settings worth a column in the overview; NAME shows them all.
_COLUMNS = (
    ("checkpoint_interval_steps", "ckpt every", None),
    ("rollback_min_steps_before_onset", "back >=", "policy"),
    ("skip_extra_batches", "skip extra", "policy"),
    ("spike_patience_steps", "patience", "policy"),
    ("lr_restore_healthy_steps", "restore after", "policy"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "presets", help="print the model profiles (small, medium, large)", description=__doc__
    )
    parser.add_argument("name", nargs="?", choices=sorted(PRESETS), help="one profile, in full")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.name:
        preset = get_preset(args.name).as_dict()
        if args.json:
            print(json.dumps(preset, indent=2))
        else:
            print(f"{preset['name']}: {preset['description']}")
            for key, value in preset.items():
                if key not in ("name", "description", "policy"):
                    print(f"  {key:34} {value}")
            print("  policy:")
            for key, value in preset["policy"].items():
                print(f"    {key:32} {value}")
        return 0
    presets = [p.as_dict() for p in PRESETS.values()]
    if args.json:
        print(json.dumps({p["name"]: p for p in presets}, indent=2))
        return 0
    header = ["name"] + [title for _, title, _ in _COLUMNS]
    rows = [
        [p["name"]] + [str((p["policy"] if where else p)[key]) for key, _, where in _COLUMNS]
        for p in presets
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    print("\n`spikeguard presets NAME` shows every setting of one profile.")
    return 0
