"""The ``spikeguard`` command. Each sub-command lives in its own module here.

A module ``spikeguard/cli/NAME.py`` defines ``register(subparsers)``, which
adds its parser and sets ``func`` (taking the parsed args, returning an exit
code); it is found by name, so adding a command is adding a file.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from spikeguard import __version__
from spikeguard.errors import SpikeguardError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spikeguard",
        description="Keeps PyTorch training runs alive through loss spikes.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    parser.add_argument("--version", action="version", version=f"spikeguard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if module.startswith("_"):
            continue
        importlib.import_module(f"{__name__}.{module}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except SpikeguardError as exc:
        print(f"spikeguard {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
