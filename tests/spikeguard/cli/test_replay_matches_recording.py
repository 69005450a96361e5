"""A replay with the recorded settings reproduces the recording exactly: the demo's run, and a
run with a rollback whose LR restores come after it (the actuator must hear the trainer's acks)."""

from __future__ import annotations

import pytest

from spikeguard.cli import main
from spikeguard.demo.model import DemoSetup
from spikeguard.demo.run import DEMO_SETTINGS, run_demo
from spikeguard.runtime import open_runtime
from spikeguard.settings import load_settings


def _recorded_demo(directory, fault: str) -> None:
    settings = load_settings({**DEMO_SETTINGS, "data_dir": str(directory)}, env={})
    with open_runtime(settings) as runtime:
        outcome = run_demo(fault, seed=0, setup=DemoSetup(), runtime=runtime)
    assert outcome.rollbacks >= 1  # a recovery to reproduce: rollback, then LR restores


@pytest.mark.parametrize("fault", ["spike", "nan"])
def test_replay_of_the_demo_with_the_recorded_settings_shows_no_difference(fault, tmp_path, capsys):
    _recorded_demo(tmp_path / "rec", fault)
    capsys.readouterr()
    assert main(["replay", "--data-dir", str(tmp_path / "rec")]) == 0
    out = capsys.readouterr().out
    assert "judged with the recorded settings" in out
    assert "decisions: 0 added, 0 removed, 0 changed" in out, out
    assert "actions: 0 added, 0 removed, 0 changed" in out, out
    assert "no differences" in out, out
