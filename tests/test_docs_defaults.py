"""The defaults the docs' settings tables give are the code's (docs/guard.md's recovery budget)."""

from __future__ import annotations

import re
from pathlib import Path

from spikeguard.producers.config import GuardConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"
ROW = re.compile(r"^\|\s*`(\w+)`\s*\|\s*([^|]+?)\s*\|")


def documented_defaults() -> list[tuple[str, str, str]]:
    """(page, setting, default as written) for every table row naming a GuardConfig field."""
    fields = GuardConfig.model_fields
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for line in page.read_text().splitlines():
            m = ROW.match(line)
            if m and m.group(1) in fields:
                found.append((page.name, m.group(1), m.group(2)))
    return found


def test_the_docs_give_the_guards_defaults():
    rows = documented_defaults()
    assert {name for _, name, _ in rows} >= {"recovery_min_steps", "max_rerun_share"}
    wrong = [
        (page, name, written, GuardConfig.model_fields[name].default)
        for page, name, written in rows
        if float(written) != float(GuardConfig.model_fields[name].default)
    ]
    assert not wrong, wrong
