"""The settings a recording was judged with, kept beside it so that a replay can reuse them.

The embedded runtime writes ``DIR/_settings.json`` when it records to
``data_dir``: the sections that decide (detectors, fusion, policy), never
connection details or secrets. The bus's own files are per-topic
directories, so this file is invisible to it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spikeguard.producers.atomic import atomic_write_bytes

if TYPE_CHECKING:
    from spikeguard.settings import Settings

FILE = "_settings.json"
JUDGEMENT = ("statistical", "rules", "ml", "predictor", "fusion", "policy")


def save(settings: "Settings", directory: str | os.PathLike) -> Path:
    """Write the judging settings beside a recording (atomically); an OSError is the caller's to
    report: a trainer's runtime goes on without the file (spikeguard/runtime)."""
    path = Path(directory) / FILE
    body = json.dumps(settings.model_dump(mode="json", include=set(JUDGEMENT)), indent=1)
    atomic_write_bytes(path, body.encode())
    return path


def load(directory: str | os.PathLike) -> dict[str, Any] | None:
    """Dotted name -> value of the recorded settings, or None if none were recorded."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    recorded = json.loads(path.read_text())
    # One level: a dict-valued field (fusion.weights) is one value, set whole.
    return {
        f"{section}.{name}": value
        for section, fields in recorded.items()
        for name, value in fields.items()
    }
