"""The backtest streams: decisions come while the input is read, the same whatever the segment."""

from __future__ import annotations

import math

import pytest

from spikeguard.lab.backtest import BATCH, backtest_events, backtest_stream
from spikeguard.lab.backtest_input import iter_steps
from spikeguard.lab.runfile import RunFileError, read_steps, write_csv
from spikeguard.lab.simulate import generate
from spikeguard.schemas import encode


@pytest.fixture(scope="module")
def run():
    return generate("sudden_spike", 9000, seed=4, run_id="s")


def dumped(decisions):
    return [d.model_dump_json() for d in decisions]


@pytest.mark.heavy
def test_decisions_come_before_the_input_is_read_to_the_end(run):
    pulled = 0

    def events():
        nonlocal pulled
        for event in run.events:
            pulled += 1
            yield event

    stream = backtest_stream(events(), segment_steps=2 * BATCH)
    first = next(stream)
    assert first.step == run.events[0].step
    assert pulled == 2 * BATCH  # one segment read, not the file
    rest = list(stream)
    assert pulled == len(run.events)
    assert len(rest) + 1 == len(run.events)


@pytest.mark.heavy
def test_the_decisions_do_not_depend_on_the_segment_size(run):
    whole = dumped(backtest_stream(run.events, segment_steps=5 * BATCH))  # one segment
    assert any('"is_anomaly":true' in line for line in whole)
    assert dumped(backtest_stream(run.events, segment_steps=BATCH)) == whole
    assert dumped(backtest_events(run.events)) == whole


def test_a_segment_size_off_the_batch_is_refused(run):
    with pytest.raises(ValueError, match="multiple of"):
        next(backtest_stream(run.events, segment_steps=BATCH + 1))


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ""])
def test_the_streamed_reader_reads_what_read_steps_reads(tmp_path, run, suffix):
    path = tmp_path / f"run{suffix}"
    events = run.events[:500]
    if suffix == ".jsonl":
        path.write_bytes(b"\n".join(encode(e) for e in events) + b"\n")
    else:
        write_csv(path, events, run.labels[:500])
    seen: list[int] = []
    streamed = list(iter_steps(path, on_progress=seen.append))
    assert streamed == read_steps(path)[0]
    assert sum(seen) == len(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("step,loss\n0,1.0\n1,abc\n", "bad.csv:3: column 'loss': 'abc' is not a number"),
        ("step,loss\n0,1.0\n0,1.0\n", "bad.csv:3: step 0 of run 'bad' comes after step 0"),
        ("loss\n1.0\n", "bad.csv:1: header ['loss'] lacks step"),
        ("step,loss,label\n0,1.0,maybe\n", "bad.csv:2: column 'label': 'maybe' is not 0/1"),
    ],
)
def test_the_streamed_reader_names_the_bad_line_as_read_steps_does(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(RunFileError) as streamed:
        list(iter_steps(path))
    with pytest.raises(RunFileError) as whole:
        read_steps(path)
    assert str(streamed.value) == str(whole.value)
    assert message in str(streamed.value)


def test_non_finite_cells_stream_as_floats(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text("step,loss,grad_norm\n0,nan,inf\n1,2.0,\n")
    first, second = iter_steps(path)
    assert math.isnan(first.loss) and first.grad_norm == math.inf
    assert second.grad_norm is None and first.run_id == "r"
