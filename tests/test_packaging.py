"""A wheel holds every package: `pip install .` (the Docker image, an install from git) ships only
what `[tool.setuptools] packages` lists, while the editable install the tests run on finds
every directory, so a package missing from the list fails only for users."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_for_the_wheel():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    roots = {name: ROOT / path for name, path in config["package-dir"].items()}
    found = set()
    for name, directory in roots.items():
        for init in directory.rglob("__init__.py"):
            relative = init.parent.relative_to(directory)
            if any(part.startswith((".", "__")) for part in relative.parts):
                continue
            found.add(".".join([name, *relative.parts]))
    assert found - listed == set(), (
        f"packages missing from pyproject.toml: {sorted(found - listed)}"
    )
