"""The chunked CSV reader: the same events and errors as runfile's row-by-row rules, past a chunk."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from spikeguard.lab.backtest_input import CHUNK_ROWS, iter_steps
from spikeguard.lab.runfile import RunFileError, read_steps

ROWS = 2 * CHUNK_ROWS + 300  # three chunks, the last one short


def _dumped(events):
    return [e.model_dump_json() for e in events]  # JSON: NaN == NaN there


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _clean_rows(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    rows = ["step,loss,grad_norm,lr,run_id,label,time"]
    for i in range(ROWS):
        loss = (
            rng.choice(["nan", "inf", "-inf", "Infinity"]) if i % 997 == 5 else repr(rng.random())
        )
        rows.append(f"{i},{loss},{rng.random() * 3},{1e-3},r1,{i % 2},{1000.0 + i}")
    return rows


def test_clean_file_over_several_chunks_reads_as_read_steps(tmp_path):
    path = tmp_path / "clean.csv"
    _write(path, _clean_rows())
    streamed = list(iter_steps(path))
    assert len(streamed) == ROWS
    assert _dumped(streamed) == _dumped(read_steps(path)[0])
    assert streamed[-1].time == 1000.0 + ROWS - 1  # a time column wins over the step clock


def test_unusual_cells_read_as_read_steps(tmp_path):
    # Interleaved runs, run ids from the file name, empty optional cells, padded
    # cells, blank lines and all-empty lines, upper-case labels: each chunk has some.
    rng = random.Random(1)
    rows = ["step, loss ,grad_norm,update_norm,run_id,label"]
    steps = {"a": 0, "b": 0, "": 0}
    for i in range(ROWS):
        run = rng.choice(["a", "b", ""])
        steps[run] += rng.randint(1, 3)
        grad = "" if i % 7 == 0 else f" {rng.random():.6f} "
        update = "" if i % 11 == 0 else repr(rng.random())
        rows.append(
            f"{steps[run]},{rng.random()},{grad},{update},{run},{'TRUE' if i % 5 else 'no'}"
        )
        if i % 500 == 3:
            rows += ["", ",,,,,"]
    path = tmp_path / "mixed.csv"
    _write(path, rows)
    streamed = list(iter_steps(path))
    assert _dumped(streamed) == _dumped(read_steps(path)[0])
    assert {e.run_id for e in streamed} == {"a", "b", "mixed"}
    assert any(e.grad_norm is None for e in streamed) and any(e.grad_norm for e in streamed)


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ("{i},abc,1.0,1e-3,r1,0,1.0", "column 'loss': 'abc' is not a number"),
        ("{i},1.0,1.0,1e-3,r1,maybe,1.0", "column 'label': 'maybe' is not 0/1"),
        ("3,1.0,1.0,1e-3,r1,0,1.0", "step 3 of run 'r1' comes after step"),
        ("-{i},1.0,1.0,1e-3,r1,0,1.0", "is negative"),
        ("{i},1.0", "2 cells, the header has 7"),
    ],
)
def test_a_bad_row_in_a_later_chunk_is_named_as_read_steps_names_it(tmp_path, bad_row, message):
    rows = _clean_rows()
    at = CHUNK_ROWS + 17  # in the second chunk
    rows[at + 1] = bad_row.format(i=at)  # +1: the header
    path = tmp_path / "bad.csv"
    _write(path, rows)
    read: list = []
    with pytest.raises(RunFileError) as streamed:
        for event in iter_steps(path):
            read.append(event)
    with pytest.raises(RunFileError) as whole:
        read_steps(path)
    assert str(streamed.value) == str(whole.value)
    assert f"bad.csv:{at + 2}:" in str(streamed.value) and message in str(streamed.value)
    assert len(read) == at  # every good step before it was read, as the row-by-row reader did


def test_events_built_in_bulk_are_the_validated_events(tmp_path):
    """The fast path builds events without a validator call each: they must be indistinguishable."""
    from spikeguard.schemas import StepEvent

    path = tmp_path / "clean.csv"
    _write(path, _clean_rows(3))
    built = list(iter_steps(path))
    for event in built[:5] + built[-5:]:
        fields = {name: getattr(event, name) for name in event.model_fields_set}
        validated = StepEvent(**fields)
        assert event == validated
        assert event.model_fields_set == validated.model_fields_set
        assert list(event.__dict__) == list(validated.__dict__)
        assert event.model_dump_json() == validated.model_dump_json()
    assert built[0].top_grad_norms == {} and built[0].top_grad_norms is not built[1].top_grad_norms
    with pytest.raises(ValidationError):  # still frozen
        built[0].loss = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ("{i},1.0,1.0,1e-3,r 1,0,1.0", "run_id"),  # a run id the schema refuses
        ("9007199254740992,1.0,1.0,1e-3,r1,0,1.0", "step"),  # past 2**53 - 1
    ],
)
def test_what_the_bulk_checks_refuse_is_named_as_read_steps_names_it(tmp_path, bad_row, message):
    rows = _clean_rows()
    at = CHUNK_ROWS + 40
    rows[at + 1] = bad_row.format(i=at)
    path = tmp_path / "bad.csv"
    _write(path, rows)
    with pytest.raises(RunFileError) as streamed:
        list(iter_steps(path))
    with pytest.raises(RunFileError) as whole:
        read_steps(path)
    assert str(streamed.value) == str(whole.value)
    assert f":{at + 2}:" in str(streamed.value) and message in str(streamed.value)


def test_quoted_cells_and_a_record_over_two_lines_read_as_read_steps(tmp_path):
    rows = _clean_rows(4)
    rows[CHUNK_ROWS + 5] = rows[CHUNK_ROWS + 5].replace(",r1,", ',"r1",')
    rows[CHUNK_ROWS + 9] = (
        rows[CHUNK_ROWS + 9]
        .replace(",r1,", ',"r1",')
        .replace(f",{1000.0 + CHUNK_ROWS + 8}", ',"\n' + f'{1000.0 + CHUNK_ROWS + 8}"')
    )
    rows.insert(CHUNK_ROWS + 20, "")
    path = tmp_path / "quoted.csv"
    _write(path, rows)
    assert _dumped(iter_steps(path)) == _dumped(read_steps(path)[0])
    rows[CHUNK_ROWS + 30] = "1,abc,1.0,1e-3,r1,0,1.0"  # a bad line after the record over two lines
    _write(path, rows)
    with pytest.raises(RunFileError) as streamed:
        list(iter_steps(path))
    with pytest.raises(RunFileError) as whole:
        read_steps(path)
    assert str(streamed.value) == str(whole.value)
