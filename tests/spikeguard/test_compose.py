"""docker-compose.yml only runs commands the CLI really has."""

import json
import re
from pathlib import Path

import pytest

from spikeguard.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def compose_commands():
    text = (ROOT / "docker-compose.yml").read_text()
    return [json.loads(m) for m in re.findall(r"^\s*command:\s*(\[.*\])\s*$", text, re.M)]


def test_compose_defines_a_worker_for_every_component():
    from spikeguard.components import COMPONENTS

    names = {cmd[2] for cmd in compose_commands() if cmd[:2] == ["spikeguard", "worker"]}
    assert names == set(COMPONENTS)


@pytest.mark.parametrize("command", compose_commands(), ids=lambda c: " ".join(c[1:3]))
def test_every_compose_command_parses(command):
    assert command[0] == "spikeguard"
    args = build_parser().parse_args(command[1:])
    assert callable(args.func)
