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


@pytest.mark.parametrize(
    "placed",
    [
        # The batch's last step far ahead at the same time: refused, the first still judged.
        [(n, 0.0) for n in range(12)] + [(40_000, 0.0)],
        # A jump too far for its time in the middle, then a step whose time allows it.
        [(n, 0.0) for n in range(12)] + [(25_000, 0.0), (25_001, 100.0)],
    ],
)
def test_a_batch_is_admitted_step_by_step_as_the_worker_admits_it(placed) -> None:
    base = generate("stable", 200, seed=12, run_id="k").events
    events = [e.model_copy(update={"step": n, "time": t}) for e, (n, t) in zip(base, placed)]
    expected = on_the_bus(events)
    assert len(expected) == len(events) - 1  # exactly one step refused
    assert direct(events) == expected


def test_verdicts_reach_fusion_step_by_step_and_by_first_place() -> None:
    from types import SimpleNamespace

    from spikeguard.lab.backtest_pump import _step_by_step

    def step(n: int) -> SimpleNamespace:
        return SimpleNamespace(run_id="a", epoch=0, step=n)

    def verdict(n: int, detector: str) -> SimpleNamespace:
        return SimpleNamespace(run_id="a", epoch=0, step=n, detector=detector)

    def judged(steps: list[int]) -> list[list[SimpleNamespace]]:
        return [[verdict(n, d) for n in steps] for d in ("x", "y")]

    def seen(verdicts) -> list[tuple[int, str]]:
        return [(v.step, v.detector) for v in verdicts]

    # Every step judged by both, places rising: a step's verdicts together, detector order.
    order = {("a", 0, n): n for n in range(4)}
    batch = [step(n) for n in range(2, 4)]
    assert seen(_step_by_step(judged([2, 3]), batch, order)) == [
        (2, "x"),
        (2, "y"),
        (3, "x"),
        (3, "y"),
    ]
    # Step 1 given again after step 3 keeps its first place (before 3), as the stager sorts it.
    order = {("a", 0, 1): 0, ("a", 0, 3): 1}
    batch = [step(3), step(1)]
    assert seen(_step_by_step(judged([3, 1]), batch, order)) == [
        (1, "x"),
        (1, "y"),
        (3, "x"),
        (3, "y"),
    ]
    # A detector that refused a step: the others' verdicts still go by place.
    lists = [[verdict(2, "x"), verdict(3, "x")], [verdict(3, "y")]]
    order = {("a", 0, 2): 0, ("a", 0, 3): 1}
    assert seen(_step_by_step(lists, [step(2), step(3)], order)) == [(2, "x"), (3, "x"), (3, "y")]
