"""Run files: CSV and JSONL in, the same events out; bad input named by line."""

from __future__ import annotations

import io
import math

import pytest

from spikeguard.lab.runfile import (
    CSV_COLUMNS,
    RunFileError,
    StepLabel,
    format_float,
    read_steps,
    write_csv,
)
from spikeguard.lab.simulate import generate
from spikeguard.schemas import StepEvent, encode


def _same(a: StepEvent, b: StepEvent) -> bool:
    return a.model_dump_json() == b.model_dump_json()


def test_csv_round_trip_keeps_every_value_and_label(tmp_path):
    run = generate("non_finite", 800, seed=2)
    path = tmp_path / "run.csv"
    write_csv(path, run.events, run.labels)
    header = path.read_text().splitlines()[0].split(",")
    assert header[: len(CSV_COLUMNS)] == list(CSV_COLUMNS)
    events, labels = read_steps(path)
    assert labels == run.labels
    assert all(_same(a, b) for a, b in zip(events, run.events)) and len(events) == 800
    text = path.read_text()
    assert ",nan," in text or ",inf," in text


def test_non_finite_values_are_spelled_plainly():
    assert [format_float(v) for v in (math.nan, math.inf, -math.inf, None, 0.1)] == [
        "nan",
        "inf",
        "-inf",
        "",
        "0.1",
    ]


def test_step_and_loss_alone_are_enough():
    events, labels = read_steps(io.StringIO("step,loss\n0,2.5\n1,nan\n2,Infinity\n"), run_id="r")
    assert labels is None
    assert [e.step for e in events] == [0, 1, 2]
    assert math.isnan(events[1].loss) and events[2].loss == math.inf
    assert events[0].grad_norm is None and events[0].run_id == "r"
    assert [e.time for e in events] == [0.0, 1.0, 2.0]  # a synthetic clock: deterministic


def test_optional_columns_and_run_ids(tmp_path):
    path = tmp_path / "my run.csv"
    path.write_text("Step,Loss,grad_norm,lr,run_id,extra\n1,3.0,0.5,,a,x\n2,2.9,,1e-3,,y\n")
    events, _ = read_steps(path)
    assert events[0].run_id == "a" and events[0].grad_norm == 0.5 and events[0].lr is None
    assert events[1].run_id == "my_run" and events[1].lr == 1e-3  # default: the file's stem


def test_jsonl_with_and_without_labels(tmp_path):
    plain = [StepEvent(run_id="j", step=i, loss=float(i), time=1.0) for i in range(3)]
    path = tmp_path / "steps.jsonl"
    path.write_bytes(b"\n".join(encode(e) for e in plain) + b"\n")
    events, labels = read_steps(path)
    assert labels is None and all(_same(a, b) for a, b in zip(events, plain))
    lines = [
        '{"run_id":"j","step":0,"loss":"NaN","label":true,"kind":"non_finite"}',
        '{"run_id":"j","step":1,"loss":1.0,"label":false}',
    ]
    events, labels = read_steps(io.StringIO("\n".join(lines)))  # sniffed: starts with "{"
    assert math.isnan(events[0].loss)
    assert labels == [StepLabel(True, "non_finite"), StepLabel(False, "")]


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "empty file"),
        ("step,value\n0,1\n", "lacks loss"),
        ("step,loss\n0,1.0\n1,abc\n", r"<stream>:3: column 'loss': 'abc' is not a number"),
        ("step,loss\n0,1.0\nx,1.0\n", r":3: column 'step'"),
        ("step,loss\n-1,1.0\n", "negative"),
        ("step,loss\n0,\n", "'loss' is empty"),
        ("step,loss\n3,1.0\n3,1.0\n", "steps must increase"),
        ("step,loss,label\n0,1.0,maybe\n", "'label'"),
        ("step,loss,grad_norm\n0,1.0\n", "2 cells"),
        ('{"run_id":"j","step":0,"loss":1}\n{"run_id":"j","step":1}\n', r"<stream>:2: .*loss"),
    ],
)
def test_bad_input_is_named_by_line(text, message):
    with pytest.raises(RunFileError, match=message):
        read_steps(io.StringIO(text))


def test_a_gzipped_csv_reads_as_the_csv_it_holds(tmp_path):
    import gzip

    text = "step,loss\n0,2.5\n1,nan\n"
    (tmp_path / "run.csv").write_text(text)
    with gzip.open(tmp_path / "run.csv.gz", "wt") as handle:
        handle.write(text)
    plain, _ = read_steps(tmp_path / "run.csv")
    packed, _ = read_steps(tmp_path / "run.csv.gz")
    assert packed[0].run_id == "run" and [e.step for e in packed] == [0, 1]
    assert [str(e.loss) for e in packed] == [str(e.loss) for e in plain]


def test_a_missing_file_is_a_run_file_error(tmp_path):
    with pytest.raises(RunFileError, match="cannot read"):
        read_steps(tmp_path / "absent.csv")
