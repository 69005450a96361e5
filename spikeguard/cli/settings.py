"""``spikeguard settings``: the effective settings and where each one came from.

Every setting is printed with its value and its source: a flag, a
``SPIKEGUARD_*`` variable, the config file, or the default. Secrets print as
``**********``. It loads settings exactly as the other commands do (the same
flags, ``--config``, environment), so it answers "what will the worker run
with, and why" before the worker is started; a bad file or variable fails here
the same way.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from spikeguard.cli._common import add_settings_flags, settings_and_origins_from


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "settings",
        help="print the effective settings and where each came from",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per setting")
    parser.add_argument(
        "--changed", action="store_true", help="only the settings not at their default"
    )
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def effective_settings(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``[{"name", "value", "source"}]`` for every setting, secrets masked, in field order."""
    from spikeguard.settings import Settings, origin_of
    from spikeguard.settings_sources import setting_names

    settings, origins = settings_and_origins_from(args)
    # mode="json" renders SecretStr as "**********": the secret never reaches this dict.
    dumped = settings.model_dump(mode="json")
    rows = []
    for name in setting_names(Settings):
        value: Any = dumped
        for part in name.split("."):
            value = value[part]
        if isinstance(value, dict):
            continue  # a component: its fields have their own rows
        rows.append({"name": name, "value": value, "source": origin_of(name, origins)})
    return rows


def run(args: argparse.Namespace) -> int:
    rows = effective_settings(args)
    if args.changed:
        rows = [row for row in rows if row["source"] != "default"]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    if args.changed and not rows:  # an empty answer looks like a broken command
        print("all defaults: no flag, SPIKEGUARD_* variable or config file changes a setting")
        return 0
    width = max((len(row["name"]) for row in rows), default=0)
    for row in rows:
        print(f"{row['name']:<{width}}  {json.dumps(row['value'])}  ({row['source']})")
    return 0
