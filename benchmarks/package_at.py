"""spikeguard as it was at a git ref, importable beside this checkout's under another name.

For an A/B of two versions in one process (a loaded machine's noise then falls on both
alike): the ref's packages (``spikeguard`` and the ``producers``, ``processors``,
``actuators`` and ``schemas`` it maps in) are copied out of git into a temporary
directory as one package ``name``, every ``spikeguard`` module name and metric prefix in
their code renamed, and that directory put on ``sys.path`` and on ``PYTHONPATH`` (the
embedded runtime's child process is spawned: it imports the copy as well).
"""

from __future__ import annotations

import importlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType

#: the packages setup maps under ``spikeguard`` (pyproject.toml's package-dir)
_MAPPED = ("producers", "processors", "actuators", "schemas")


def package_at(ref: str, name: str = "spikeguard_at_ref") -> ModuleType:
    """The package as at ``ref``, imported as ``name`` (its subpackages as ``name.x``)."""
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "spikeguard", *_MAPPED],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    where = Path(tempfile.mkdtemp(prefix="spikeguard-at-"))
    root = where / name
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.endswith(".py"):
                continue
            top, _, rest = member.name.partition("/")
            target = root / rest if top == "spikeguard" else root / top / rest
            target.parent.mkdir(parents=True, exist_ok=True)
            extracted = tar.extractfile(member)
            assert extracted is not None
            source = extracted.read().decode()
            # metric prefixes first (a renamed module name has the prefix's shape)
            source = re.sub(r"\bspikeguard\b", name, source.replace("spikeguard_", f"{name}_"))
            target.write_text(source)
    sys.path.insert(0, str(where))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(where), os.environ.get("PYTHONPATH", "")) if p
    )
    return importlib.import_module(name)
