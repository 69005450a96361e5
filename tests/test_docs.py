"""The user docs stand on their own: links resolve, no path outside the project, no history.

A user's clone has only the repository, and reads the docs as what is true
now: a link to a missing page, a path beside the clone, or "this round" /
"issue 12" in a guide is a defect a reader meets.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "CHANGELOG.md",
        *(ROOT / "docs").glob("*.md"),
    ]
)
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
HISTORY = re.compile(
    r"\b(this|last|previous|next) round\b|\brounds? ago\b|\bissue #?\d+|\bthis session\b", re.I
)


#: Guides that other pages link to and that are written alongside these; checked once present.
def _ids(pages):
    return [str(page.relative_to(ROOT)) for page in pages]


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_relative_link_resolves(page):
    missing = []
    for target, _ in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path = (page.parent / target).resolve()
        if not path.exists():
            missing.append(target)
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_no_path_outside_the_project(page):
    text = page.read_text()
    sibling = ".." + "/shared"  # spelt apart, so that this file does not match itself
    assert sibling not in text and "/work/" not in text


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_no_history_in_user_docs(page):
    assert HISTORY.findall(page.read_text()) == []


def test_the_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 205
    # The two commands CI and users run, and the first example in observe mode.
    assert "scripts/demo.sh" in text and "scripts/test.sh" in text
    assert 'mode="observe"' in text
    assert "--index-url https://download.pytorch.org/whl/cpu" in text


def test_the_readme_shows_recovery_on_every_fault_of_the_benchmark():
    """One row per fault of benchmarks/recovery_faults.py, each with an interval and a why."""
    import ast

    source = (ROOT / "benchmarks" / "recovery_faults.py").read_text()
    faults = next(
        ast.literal_eval(node.value)
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "FAULTS"
    )
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Recovery") :]
    section = section[: section.index("\n## ")]
    rows = {
        line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| ")
    }
    assert set(faults) <= set(rows), sorted(set(faults) - set(rows))
    for fault in faults:
        cells = [c.strip() for c in rows[fault].split("|")[1:-1]]
        assert re.search(r"\[\d\.\d+, \d\.\d+\]", cells[1]) and cells[4], fault


def test_the_pages_exist():
    names = {page.name for page in PAGES}
    assert {
        "design.md",
        "benchmarks.md",
        "kafka.md",
        "offline.md",
        "forensics.md",
        "integrations.md",
    } <= names
    assert "## Recovery" in (ROOT / "docs" / "benchmarks.md").read_text()
