"""The run's state: one typed record the Guard's parts read and move (producers/run_state.py)."""

from __future__ import annotations

import pytest

from spikeguard.producers.run_state import Counters, RunState


def test_counters_read_and_bump_by_name_and_compare_as_a_mapping():
    counters = Counters()
    counters["rollbacks"] += 1
    counters.skipped_steps += 3
    assert counters.rollbacks == counters["rollbacks"] == 1
    assert dict(counters)["skipped_steps"] == 3
    assert counters == {**{name: 0 for name in counters}, "rollbacks": 1, "skipped_steps": 3}


def test_a_misspelt_counter_fails_instead_of_starting_a_new_one():
    counters = Counters()
    with pytest.raises(KeyError):
        counters["rolbacks"] = 1
    with pytest.raises(KeyError):
        counters["rolbacks"]
    assert "rolbacks" not in counters


def test_the_run_is_done_when_stopped_or_at_its_planned_length():
    run = RunState("r1", step_count=4)
    assert not run.done()
    run.max_steps = 4
    assert run.done()
    run.max_steps = None
    run.request_stop("an operator's stop")
    assert run.done() and run.stop_reason == "an operator's stop"
