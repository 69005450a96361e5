"""The healthy-run suite: every kind trains for real, seeded, and the checked-in CSVs are its output."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from spikeguard.lab.healthy_runs import KINDS, StepRecord, main, record
from spikeguard.lab.runfile import read_steps

SUITE = Path(__file__).parents[3] / "data" / "healthy"


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.heavy
def test_each_kind_trains_and_repeats_itself_with_its_seed(kind):
    first, again = record(kind, steps=30), record(kind, steps=30)
    assert first == again
    assert [r.step for r in first] == list(range(30))
    assert all(math.isfinite(r.loss) and r.grad_norm > 0 and r.lr > 0 for r in first)
    assert record(kind, steps=30, seed=1) != first


def test_the_schedules_do_what_their_kinds_say():
    drop = record("lr_drop", steps=40)  # x0.1 half-way, for good
    assert {r.lr for r in drop[:20]} == {1e-2} and [r.lr for r in drop[20:]] == pytest.approx(
        [1e-3] * 20
    )
    restarts = [r.lr for r in record("warm_restarts", steps=70)]  # T_0 = 70 // 7 = 10
    assert restarts[10] > restarts[9] and restarts[10] == pytest.approx(restarts[0])
    ramp = [r.lr for r in record("warmup", steps=50)]  # up over the first 10, then down
    assert ramp[:10] == sorted(ramp[:10]) and ramp[9] == max(ramp) and ramp[-1] < ramp[10]
    assert len({r.lr for r in record("regression_b1", steps=20)}) == 1  # constant LR elsewhere


def test_the_command_writes_csvs_the_tools_read(tmp_path):
    assert (
        main(["--out", str(tmp_path), "--steps", "25", "--kinds", "regression_b4", "falling"]) == 0
    )
    events, labels = read_steps(tmp_path / "falling.csv")
    assert len(events) == 25 and labels is None
    assert all(e.grad_norm is not None and e.lr == pytest.approx(1e-4) for e in events)
    sources = (tmp_path / "SOURCES.md").read_text()
    assert (
        "--steps 25" in sources and "regression_b4.csv" in sources and "char_lm.csv" not in sources
    )


@pytest.mark.heavy
def test_the_checked_in_suite_is_what_the_generator_makes():
    assert {p.stem for p in SUITE.glob("*.csv")} == set(KINDS)
    for path in SUITE.glob("*.csv"):
        events, _ = read_steps(path)
        assert len(events) == 5000, path.name
    # Remade: the first steps of a kind whose set-up does not depend on the run's length.
    made = record("regression_b32", steps=200)
    stored, _ = read_steps(SUITE / "regression_b32.csv")
    assert [r.loss for r in made] == pytest.approx([e.loss for e in stored[:200]], rel=1e-4)
    assert isinstance(made[0], StepRecord)
