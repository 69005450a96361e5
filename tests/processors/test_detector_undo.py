"""A detector's per-batch undo copy (``undo_state``) puts its run back exactly, without its JSON.

A worker takes ``Stage.undo_point`` before every batch and restores it only when
the batch fails; the copy is the state as the rollback history packs it.
"""

from __future__ import annotations

import pytest

from spikeguard.lab.simulate import generate
from spikeguard.processors.detectors import CONFIGS, DETECTORS


def verdicts(detector, events, size=250):
    out = []
    for i in range(0, len(events), size):
        out += detector.update_many(events[i : i + size])
    return [v.model_dump() for v in out]


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_an_undone_batch_is_judged_again_as_if_it_never_ran(name):
    # 1,500 steps: the ML forest is fitted before the undo point and refitted inside the undone part.
    events = generate("sudden_spike", 1500, 3, run_id="undo").events
    first, rest = events[:700], events[700:]
    once = DETECTORS[name](CONFIGS[name]())
    verdicts(once, first)
    expected = verdicts(once, rest)

    detector = DETECTORS[name](CONFIGS[name]())
    verdicts(detector, first)
    undo = detector.undo_state()
    verdicts(detector, rest)  # the batch that "fails"
    detector.load_state_dict(undo)
    assert verdicts(detector, rest) == expected
    assert detector.state_dict() == once.state_dict()


def test_the_ml_undo_copy_shares_its_rows_instead_of_dumping_them():
    detector = DETECTORS["ml"](CONFIGS["ml"](forest=True))  # the rows it shares are the forest's
    verdicts(detector, generate("stable", 1200, 1, run_id="undo").events)
    undo = detector.undo_state()
    assert "pending" not in undo and "fitted" not in undo  # no JSON rows
    head, pending, count, shared = undo["undo"]
    assert pending is detector.state.pending and count == len(detector.state.pending)
    assert shared[0] is detector.state.fitted
