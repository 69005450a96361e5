"""Lint and type check the project, as CI does: ``python scripts/lint.py``.

Runs ``ruff check`` and ``ruff format --check`` over the repository and
``mypy`` over the package and ``benchmarks/``, all with the settings in
pyproject.toml, and exits non-zero if any finds anything. It never reformats: run ``ruff format`` on the
files you touch.

mypy cannot follow the package-dir mapping of pyproject.toml (``schemas/`` is
``spikeguard.schemas``, ...), so it checks a tree of symbolic links that puts
the four top-level folders under ``spikeguard/``, with a ``benchmarks`` link
beside it (no ``__init__.py``: its scripts import each other as top-level
modules, as they do when run). Both are checked in one mypy run, so the
package is analysed once; the tree and mypy's cache are kept outside the clone
(``$SPIKEGUARD_CACHE``, default ``~/.cache/spikeguard``): a warm run takes
seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: top-level folder -> where it installs under the one import name (pyproject.toml's package-dir)
MAPPED = {
    "schemas": "schemas",
    "producers": "producers",
    "processors": "processors",
    "actuators": "actuators",
}


def cache_dir() -> Path:
    base = Path(os.environ.get("SPIKEGUARD_CACHE", Path.home() / ".cache" / "spikeguard"))
    # One tree per clone: two clones sharing the cache must not check each other's files.
    return base / "mypy" / hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]


def package_tree(where: Path) -> Path:
    """``where/spikeguard``: links to every entry of ``spikeguard/`` plus the mapped folders."""
    tree = where / "spikeguard"
    tree.mkdir(parents=True, exist_ok=True)
    wanted = {
        entry.name: entry
        for entry in (ROOT / "spikeguard").iterdir()
        if entry.name != "__pycache__"
    }
    wanted.update({name: ROOT / folder for name, folder in MAPPED.items()})
    for link in tree.iterdir():
        if link.name not in wanted or link.resolve() != wanted[link.name].resolve():
            link.unlink()
    for name, target in wanted.items():
        if not (tree / name).is_symlink():
            (tree / name).symlink_to(target)
    return tree


def benchmarks_link(where: Path) -> Path:
    """``where/benchmarks``: a link to the clone's ``benchmarks/``, checked beside the package."""
    link = where / "benchmarks"
    target = ROOT / "benchmarks"
    if link.is_symlink() and link.resolve() != target.resolve():
        link.unlink()
    if not link.is_symlink():
        link.symlink_to(target)
    return link


def run_ruff(paths: list[str]) -> int:
    """``ruff check`` and ``ruff format --check``: lint findings and unformatted files both fail."""
    config = ["--config", str(ROOT / "pyproject.toml")]
    checked = subprocess.call([sys.executable, "-m", "ruff", "check", *config, *paths], cwd=ROOT)
    formatted = subprocess.call(
        [sys.executable, "-m", "ruff", "format", "--check", *config, *paths], cwd=ROOT
    )
    return checked or formatted


def run_mypy(targets: list[str] | None = None) -> int:
    cache = cache_dir()
    tree = package_tree(cache / "src")
    benchmarks = benchmarks_link(tree.parent)
    command = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "--cache-dir",
        str(cache / "cache"),
        *(targets or [tree.name, benchmarks.name]),
    ]
    return subprocess.call(command, cwd=tree.parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ruff-only", action="store_true", help="skip the type check")
    args = parser.parse_args(argv)
    failed = run_ruff(["."]) != 0
    if not args.ruff_only:
        failed = run_mypy() != 0 or failed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
