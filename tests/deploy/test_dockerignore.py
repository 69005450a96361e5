"""The image's build context leaves out what can be gigabytes and never goes into the image."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_build_context_excludes_history_checkpoints_and_environments():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "spikeguard-checkpoints", "*.pt", "tests"} <= ignored
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", (ROOT / "Dockerfile").read_text(), re.M)
    for sources in copied:  # nothing the Dockerfile copies is ignored
        for source in sources.split():
            assert source not in ignored, source
