"""Flags every command that loads settings shares: a config file, the connection, --set overrides."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spikeguard.settings import Settings


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "settings (flags > SPIKEGUARD_* env > config file > defaults)"
    )
    group.add_argument(
        "--config",
        metavar="FILE",
        help="settings file, TOML (or YAML with pyyaml) with the names --set takes, "
        "e.g. [fusion] threshold = 0.5; default: $SPIKEGUARD_CONFIG",
    )
    group.add_argument(
        "--bootstrap-servers",
        metavar="HOST:PORT",
        help="Kafka brokers; default: $SPIKEGUARD_BOOTSTRAP_SERVERS, else the embedded bus",
    )
    group.add_argument("--topic-prefix", metavar="PREFIX", help="topic name prefix")
    group.add_argument(
        "--set",
        action="append",
        metavar="NAME=VALUE",
        help="any setting by dotted name, e.g. fusion.threshold=0.5 (repeatable)",
    )


def settings_from(args: argparse.Namespace, **extra: object) -> "Settings":
    return settings_and_origins_from(args, **extra)[0]


def settings_and_origins_from(
    args: argparse.Namespace, **extra: object
) -> "tuple[Settings, dict[str, str]]":
    """The command's settings, and where each value given came from (flag, env, file)."""
    # Imported here: building the parser must not import every detector (and torch).
    from spikeguard.settings import load_settings_with_origins, parse_assignments

    overrides: dict[str, object] = {**parse_assignments(getattr(args, "set", None))}
    if getattr(args, "bootstrap_servers", None):
        overrides["bootstrap_servers"] = args.bootstrap_servers
    if getattr(args, "topic_prefix", None):
        overrides["topic_prefix"] = args.topic_prefix
    overrides.update({k: v for k, v in extra.items() if v is not None})
    return load_settings_with_origins(overrides, config_file=getattr(args, "config", None))


def terminal_bar(iterable: Any = None, **options: Any) -> Any:
    """A tqdm progress bar on stderr when it is a terminal; None otherwise, so piped
    or captured output stays exactly what it was."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    try:
        columns = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        columns = 0
    # A terminal that reports no width (a bare pty) would get an empty bar from tqdm.
    width: dict = {"dynamic_ncols": True} if columns else {"ncols": 80, "nrows": 24}
    return tqdm(iterable, file=sys.stderr, leave=False, **width, **options)
