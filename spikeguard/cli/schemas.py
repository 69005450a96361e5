"""``spikeguard schemas``: print the JSON Schema of every event."""

from __future__ import annotations

import argparse
import json

from spikeguard.schemas import json_schemas


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "schemas", help="print the JSON Schemas of the events", description=__doc__
    )
    parser.add_argument("--name", help="only this event (e.g. StepEvent)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    schemas = json_schemas()
    if args.name:
        if args.name not in schemas:
            raise SystemExit(f"unknown event {args.name!r}; known: {', '.join(sorted(schemas))}")
        schemas = schemas[args.name]
    print(json.dumps(schemas, indent=2))
    return 0
