"""A recorded run that rolled back backtests (issue 38): after a rollback the steps go back and
the records carry the next epoch, and that is the run, not a disorder in the file."""

from __future__ import annotations

import json

import pytest

from spikeguard.cli import main
from spikeguard.lab.runfile import RunFileError, read_steps
from spikeguard.lab.simulate import generate
from spikeguard.schemas import StepEvent, encode


def _recorded(tmp_path, epochs_after: int = 1) -> tuple:
    """A run that went to step 255, rolled back to 140 and ran on to 399 in ``epochs_after``."""
    events = generate("stable", 400, 0, run_id="real-spike").events
    rerun = [e.model_copy(update={"epoch": epochs_after}) for e in events[141:]]
    path = tmp_path / "recorded.jsonl"
    path.write_text("\n".join(encode(e).decode() for e in events[:256] + rerun) + "\n")
    return path, events[:256] + rerun


def test_a_run_that_rolled_back_reads_and_backtests(tmp_path) -> None:
    path, written = _recorded(tmp_path)
    events, _ = read_steps(path)
    assert [(e.epoch, e.step) for e in events] == [(e.epoch, e.step) for e in written]
    out = tmp_path / "out.jsonl"
    assert main(["backtest", str(path), "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert all(line["run_id"] == "real-spike" for line in lines)


def test_steps_still_increase_within_an_epoch(tmp_path) -> None:
    path, _ = _recorded(tmp_path, epochs_after=0)
    with pytest.raises(RunFileError, match="step 141 of run 'real-spike' comes after step 255"):
        read_steps(path)


def test_an_epoch_never_goes_back(tmp_path) -> None:
    events = generate("stable", 200, 0, run_id="r").events
    mixed: list[StepEvent] = [
        *(e.model_copy(update={"epoch": 1}) for e in events[:10]),
        *events[10:],
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(encode(e).decode() for e in mixed) + "\n")
    with pytest.raises(RunFileError, match="epoch 0 .* after epoch 1"):
        read_steps(path)
