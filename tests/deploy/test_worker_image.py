"""The worker image needs no torch: the workers never import it, and it is only an extra."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Everything a worker process does: settings, every stage, the worker and monitor
# commands, /metrics, and the whole pipeline over steps with a NaN in them.
_WORKER = """
import sys
from spikeguard.cli import build_parser
from spikeguard.components import COMPONENTS, build_stage
from spikeguard.lab.backtest import backtest_events
from spikeguard.schemas import StepEvent
from spikeguard.settings import load_settings
import spikeguard.runtime.monitoring, spikeguard.metrics_http, spikeguard.cli.worker
build_parser().parse_args(["worker", "all"])
settings = load_settings(env={})
for name in COMPONENTS:
    build_stage(name, settings)
events = [StepEvent(run_id="w", step=i, loss=float("nan") if i == 150 else 1.0 + 0.01 * (i % 3))
          for i in range(200)]
found = [d for d in backtest_events(events) if d.is_anomaly]
assert found and found[0].step == 150, found
print("torch" in sys.modules)
"""


def test_workers_never_import_torch():
    done = subprocess.run([sys.executable, "-c", _WORKER], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_torch_is_an_extra_and_the_image_does_not_install_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(r.startswith("torch") for r in project["dependencies"])
    assert project["optional-dependencies"]["torch"] == ["torch>=2.2"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    installs = [line for line in dockerfile.splitlines() if "pip " in line]
    assert installs and not any("torch" in line or "[" in line for line in installs)
    assert "HEALTHCHECK" in dockerfile
