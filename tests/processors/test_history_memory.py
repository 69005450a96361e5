"""A run's rollback history is kept compactly, and gives back exactly the state it saved.

The "scale in runs" aim (docs/benchmarks.md): 10,000 runs through one worker in <= 1 GiB, so
about 100 kB a run at most. The history's 16 snapshots, kept as live Python
objects, were most of a detector's memory (107 of 123 kB for a statistical
run); kept packed (pickled state dicts) they are 24 kB.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from spikeguard.processors.detectors import CONFIGS, DETECTORS
from spikeguard.schemas import StepEvent
from spikeguard.streaming.footprint import deep_size

# Bytes one run of each detector may hold after that many steps: history and state.
# Before: statistical 123 kB, rules 73 kB, predictor 27 kB after 1300 steps (mostly
# snapshots as live objects); ml over 1.2 MB after 4500: its pending rows copied into every
# snapshot as 152-byte numpy rows, snapshots from before a refit keeping their ~450 kB
# forests alive, fitted rows as views keeping every stacked row alive. Today's figures
# are in the failure message. The statistical detector's climb test keeps its statistic's
# own past as its null (up to 1,000 values and 500 waiting to join, so that a wandering loss is
# not taken for a climb): 251 kB before it, 363 kB at 1,300 steps, in the state and in each
# history snapshot. "A divergence keeps rising" adds the elevation's first and the last 10
# points (377.8 kB before, 380.2 kB after).
# The rules' two jump memories add ~1.4 kB (4 values each, in the state and every snapshot:
# 39.7 kB before, 41.1 kB after).
STEPS = {"statistical": 1300, "rules": 1300, "predictor": 1300, "ml": 4500}
BOUNDS = {"statistical": 385_000, "rules": 44_000, "predictor": 16_000, "ml": 650_000}


def steps(n: int, seed: int = 0) -> list[StepEvent]:
    """A falling loss with noise and a spike every 97 steps (as benchmarks/bench_scale_runs.py)."""
    rng = random.Random(seed)
    out = []
    for t in range(n):
        loss = 2.5 * (0.999**t) + rng.gauss(0, 0.02)
        if t and t % 97 == 0:
            loss *= 3
        out.append(
            StepEvent(
                run_id="r",
                step=t,
                loss=loss,
                grad_norm=1.0 + rng.gauss(0, 0.05),
                lr=1e-3,
                update_norm=1e-3 * math.exp(rng.gauss(0.0, 0.05)),
                param_norm=50.0,
                time=0.0,
            )
        )
    return out


def text(detector, state) -> str:  # type: ignore[no-untyped-def]
    """A state as JSON text: NaN == NaN, and any difference shows."""
    return json.dumps(detector.dump(state), sort_keys=True)


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_a_run_holds_little_memory_after_many_steps(name: str) -> None:
    det = DETECTORS[name](CONFIGS[name]())
    for event in steps(STEPS[name]):
        det.update(event)
    assert len(det.history) >= 10  # the history is full: this measures what it costs
    held = deep_size(det)
    assert held <= BOUNDS[name], (
        f"{name}: {held:,} bytes per run ({deep_size(det.history):,} in the history)"
    )


@pytest.mark.parametrize("name", sorted(DETECTORS))
@pytest.mark.heavy
def test_every_snapshot_gives_back_the_state_it_saved(name: str) -> None:
    """Packed snapshots are independent of what the run does after them (the ML
    detector's snapshots share its pending rows with the live state, by prefix)."""
    det = DETECTORS[name](CONFIGS[name]())
    saved: dict[int, str] = {}
    for event in steps(STEPS[name], seed=3):
        due = det.history.due(event.step)
        before = text(det, det.state)
        det.update(event)
        if due:
            saved[event.step] = before
    kept = det.history.steps()
    assert len(kept) >= 10
    for step in reversed(kept):  # newest first: rewind drops what is after it
        found = det.history.rewind(step, det.unpack)
        assert found is not None and found[0] == step
        assert text(det, found[1]) == saved[step], f"{name}: snapshot at {step} differs"
        # A snapshot given back is a copy: changing it changes no other.
        again = det.history.rewind(step, det.unpack)
        assert again is not None and again[1] is not found[1]


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_a_rolled_back_state_learns_without_changing_the_snapshot(name: str) -> None:
    det = DETECTORS[name](CONFIGS[name]())
    events = steps(900, seed=5)
    for event in events:
        det.update(event)
    step = det.history.steps()[-3]
    snapshot = det.history.rewind(step, det.unpack)
    assert snapshot is not None
    before = text(det, snapshot[1])
    det.state = snapshot[1]
    for event in events[step : step + 120]:  # the same steps again, learnt into the restored state
        det.update(event.model_copy(update={"epoch": 0}))
    again = det.history.rewind(step, det.unpack)
    assert again is not None and text(det, again[1]) == before
