"""The bus-free pump makes the bus pump's decisions, byte for byte, on the same input."""

from __future__ import annotations

import pytest

from spikeguard.lab.backtest import (
    BATCH,
    JUDGES,
    OfflinePipeline,
    backtest_stream,
    offline,
)
from spikeguard.lab.backtest_pump import DirectPipeline
from spikeguard.lab.simulate import generate
from spikeguard.processors.detectors.statistical import StatisticalDetector
from spikeguard.schemas import Decision, StepEvent, Topics
from spikeguard.settings import load_settings


def on_the_bus(events: list[StepEvent], segment_steps: int = 2 * BATCH) -> list[str]:
    """The decisions of OfflinePipeline (Workers over an embedded bus), fed as backtest_stream feeds."""
    settings = load_settings(env={})
    topics = Topics(settings.topic_prefix)
    pipeline = OfflinePipeline(settings, JUDGES, {topics.decisions: Decision})
    out: list = []
    for start in range(0, len(events), segment_steps):
        segment = [(topics.steps, e) for e in events[start : start + segment_steps]]
        out += pipeline.feed(segment)[topics.decisions]
    out += pipeline.finish()[topics.decisions]
    return [d.model_dump_json() for d in out]


def direct(events: list[StepEvent], segment_steps: int = 2 * BATCH) -> list[str]:
    return [d.model_dump_json() for d in backtest_stream(events, segment_steps=segment_steps)]


def interleaved(*runs: list[StepEvent]) -> list[StepEvent]:
    """Several runs' steps mixed as a shared file would hold them (each run in order)."""
    out: list[StepEvent] = []
    longest = max(map(len, runs))
    for i in range(0, longest, 7):
        for k, run in enumerate(runs):
            out += run[i : i + 7 - 2 * k]  # uneven slices: batches cut runs at odd places
            out += run[i + 7 - 2 * k : i + 7]
    return out


@pytest.mark.heavy
def test_one_run_with_a_spike_cut_into_uneven_segments() -> None:
    events = generate("sudden_spike", 5300, seed=3, run_id="a").events
    expected = on_the_bus(events)
    assert any('"is_anomaly":true' in line for line in expected)
    assert direct(events) == expected
    assert len(expected) == len(events)


@pytest.mark.heavy
def test_several_runs_in_one_file_non_finite_values_among_them() -> None:
    a = generate("non_finite", 2600, seed=1, run_id="a").events
    b = generate("grad_explosion", 2600, seed=2, run_id="b").events
    events = interleaved(a, b)
    expected = on_the_bus(events)
    assert {'"run_id":"a"' in line for line in expected} == {True, False}
    assert direct(events) == expected


@pytest.mark.heavy
def test_a_rollback_re_runs_steps_in_a_new_epoch() -> None:
    first = generate("divergence", 3000, seed=5, run_id="r").events
    again = generate("stable", 1500, seed=6, run_id="r").events
    rerun = [e.model_copy(update={"epoch": 1, "step": 2500 + i}) for i, e in enumerate(again)]
    events = first + rerun
    expected = on_the_bus(events)
    assert any('"epoch":1' in line for line in expected)
    assert direct(events) == expected


@pytest.mark.heavy
def test_a_replayed_step_is_refused_by_both() -> None:
    events = generate("sudden_spike", 2500, seed=7, run_id="d").events
    events = events[:2100] + [events[2050]] + events[2100:]  # a step already judged
    expected = on_the_bus(events)
    assert len(expected) == len(events) - 1
    assert direct(events) == expected


@pytest.mark.heavy
def test_a_failing_step_is_dropped_and_the_batch_rewound_by_both(monkeypatch) -> None:
    score = StatisticalDetector.score

    def failing(self, event, state):
        if event.step == 1234:
            raise ValueError("a detector bug on one step")
        return score(self, event, state)

    monkeypatch.setattr(StatisticalDetector, "score", failing)
    events = generate("sudden_spike", 2500, seed=8, run_id="f").events
    expected = on_the_bus(events)
    missing = [line for line in expected if '"step":1234,' in line]
    assert len(missing) == 1 and '"missing":["statistical"]' in missing[0]
    assert direct(events) == expected


@pytest.mark.heavy
def test_the_pump_can_be_fed_segment_by_segment_then_finished() -> None:
    events = generate("gradual_spike", 4100, seed=9, run_id="g").events
    pipeline = DirectPipeline(offline(load_settings(env={})))
    got = (
        pipeline.feed(events[: 2 * BATCH]) + pipeline.feed(events[2 * BATCH :]) + pipeline.finish()
    )
    assert [d.model_dump_json() for d in got] == on_the_bus(events)


@pytest.mark.parametrize("segment", [BATCH, 3 * BATCH])
@pytest.mark.heavy
def test_segment_size_changes_nothing(segment: int) -> None:
    events = generate("oscillation", 4500, seed=10, run_id="o").events
    assert direct(events, segment) == on_the_bus(events)


@pytest.mark.heavy
def test_a_far_future_step_is_refused_by_both() -> None:
    """Steps past the stage's max_step_gap are refused one by one, in a batch or not."""
    events = generate("sudden_spike", 2400, seed=11, run_id="j").events
    jump = [e.model_copy(update={"step": e.step + 3_000_000}) for e in events[2300:]]
    events = events[:2300] + jump
    expected = on_the_bus(events)
    assert (
        len(expected) == 2300
    )  # the jumped steps are all refused (each is far past the last admitted)
    assert direct(events) == expected
