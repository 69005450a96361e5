"""ruff and mypy pass on the project, with the settings in pyproject.toml (scripts/lint.py).

The first run of mypy on a fresh cache takes minutes on a loaded 2-core
machine; later runs reuse the cache outside the clone and take seconds.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = os.environ.get("SPIKEGUARD_PYTHON", sys.executable)

spec = importlib.util.spec_from_file_location("lint", ROOT / "scripts" / "lint.py")
lint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lint)


def _lint(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, str(ROOT / "scripts" / "lint.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1200,
    )


@pytest.mark.timeout(1500)
def test_the_project_passes_ruff_and_mypy():
    done = _lint()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout


def test_ruff_applies_the_project_rules(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\n\nx = '" + "a" * 120 + "'\n")
    done = subprocess.run(
        [
            PYTHON,
            "-m",
            "ruff",
            "check",
            "--config",
            str(ROOT / "pyproject.toml"),
            "--output-format",
            "concise",
            str(probe),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "F401" in done.stdout and "E501" in done.stdout


def test_the_type_check_tree_maps_the_top_level_folders(tmp_path):
    tree = lint.package_tree(tmp_path)
    for name, folder in lint.MAPPED.items():
        assert (tree / name).resolve() == (ROOT / folder).resolve()
        assert (tree / name / "__init__.py").exists()
    assert (tree / "__init__.py").resolve() == (ROOT / "spikeguard" / "__init__.py").resolve()
    # A stale link (a module since deleted) goes on the next run.
    (tree / "gone.py").symlink_to(tmp_path / "nowhere.py")
    lint.package_tree(tmp_path)
    assert not (tree / "gone.py").is_symlink()


def test_an_unformatted_file_fails_the_lint_and_a_formatted_one_passes(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("x = {  'a':1 }\n")  # lint-clean, but not as ruff format writes it
    assert lint.run_ruff([str(probe)]) != 0
    probe.write_text('x = {"a": 1}\n')
    assert lint.run_ruff([str(probe)]) == 0


def test_the_type_check_tree_holds_the_benchmarks_beside_the_package(tmp_path):
    link = lint.benchmarks_link(tmp_path)
    assert link.parent == lint.package_tree(tmp_path).parent
    assert link.resolve() == (ROOT / "benchmarks").resolve()
    # No __init__.py: its scripts import each other as top-level modules, as when they run.
    assert not (link / "__init__.py").exists()
    # A link to another clone's benchmarks goes on the next run.
    link.unlink()
    link.symlink_to(tmp_path)
    lint.benchmarks_link(tmp_path)
    assert link.resolve() == (ROOT / "benchmarks").resolve()


def test_mypy_checks_the_package_and_the_benchmarks_in_one_run(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIKEGUARD_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(lint.subprocess, "call", lambda command, cwd: calls.append((command, cwd)))
    lint.run_mypy()
    [(command, cwd)] = calls  # one run: the package is analysed once for both
    assert command[-2:] == ["spikeguard", "benchmarks"]
    assert (Path(cwd) / "benchmarks").resolve() == (ROOT / "benchmarks").resolve()
