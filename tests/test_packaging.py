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


def test_every_data_file_inside_a_package_is_listed_for_the_wheel():
    """A file the code reads from its own package (labels, the demo's text) ships only if
    ``[tool.setuptools.package-data]`` names it; the editable install finds it either way."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {name: ROOT / path for name, path in config["package-dir"].items()}
    patterns = config.get("package-data", {})
    unlisted = []
    for name, directory in roots.items():
        for path in directory.rglob("*"):
            relative = path.relative_to(directory)
            if (
                not path.is_file()
                or path.suffix in (".py", ".pyc")
                or any(part.startswith((".", "__")) for part in relative.parts)
                or (
                    name == "spikeguard"
                    and relative.parts[0] in set(config["package-dir"]) - {"spikeguard"}
                )
            ):
                continue
            # the package a file belongs to is its nearest directory holding an __init__.py
            package_dir = path.parent
            while not (package_dir / "__init__.py").exists():
                package_dir = package_dir.parent
            package = ".".join([name, *package_dir.relative_to(directory).parts])
            inside = path.relative_to(package_dir)
            if not any(inside.match(glob) for glob in patterns.get(package, [])):
                unlisted.append(f"{package}: {inside}")
    assert unlisted == [], f"data files missing from package-data: {unlisted}"
