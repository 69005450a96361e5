"""``spikeguard demo``: the command line, the JSON outcome and the report (PNG and HTML)."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from spikeguard.cli import main
from spikeguard.demo.plot import report_outcome
from spikeguard.demo.run import DemoOutcome


@pytest.mark.pipeline
def test_demo_json_and_plot(tmp_path, capsys):
    png = tmp_path / "curve.png"
    assert main(["demo", "--fault", "nan", "--steps", "150", "--json", "--plot", str(png)]) == 0
    outcome = json.loads(capsys.readouterr().out)
    for key in (
        "final_eval_loss",
        "steps",
        "incidents",
        "rollbacks",
        "skipped_batches",
        "actions_applied",
    ):
        assert key in outcome
    assert outcome["steps"] == 150 and outcome["nonfinite_updates"] == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1200, 800)  # matplotlib, 12 x 8 inches at 100 dpi
    page = (tmp_path / "curve.html").read_text()
    assert "non_finite" in page and "<td>rollback</td>" in page


def test_plot_handles_nan_and_rollbacks(tmp_path):
    """An unguarded outcome (losses only), NaN and a re-run stretch (steps 40..50) included."""
    outcome = DemoOutcome("nan", False, 0, 80, float("nan"))
    outcome.losses = [(s, 0, 3.0 - s * 0.01) for s in range(50)] + [(50, 0, float("nan"))]
    outcome.losses += [(s, 1, 2.6 - s * 0.01) for s in range(40, 80)]
    page = report_outcome(outcome, str(tmp_path / "x.png"))
    assert (tmp_path / "x.png").stat().st_size > 100
    assert "11 re-run after rollbacks" in (tmp_path / "x.html").read_text()
    assert page == str(tmp_path / "x.html")


def test_the_cli_constants_match_the_demo_model():
    from spikeguard.cli import demo as demo_cli
    from spikeguard.demo import model as demo_model

    assert tuple(demo_cli.FAULTS) == tuple(demo_model.FAULTS)
    assert demo_model.DemoSetup.steps == demo_cli.DEFAULT_STEPS


def test_the_demo_trains_on_its_shipped_text_whichever_python_runs_it(monkeypatch, tmp_path):
    """The README's losses are the demo's on every Python: its text ships with it, rather than
    being read from the interpreter's own ``argparse.py`` (3.11.2 and 3.11.7 differ)."""
    import argparse

    from spikeguard.demo import model

    other_python = tmp_path / "argparse.py"
    other_python.write_text("# another Python's argparse\n" * 100, encoding="utf-8")
    monkeypatch.setattr(argparse, "__file__", str(other_python))
    text = model.corpus()
    assert len(text) == 99_661  # CPython 3.11.7's argparse.py
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == "dc1eba8adfdf6159"
