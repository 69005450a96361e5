"""A run file's steps one at a time, for a backtest whose memory must not grow with the file.

:func:`spikeguard.lab.runfile.read_steps` returns whole lists (evaluation
needs the labels beside the steps); a backtest only walks the steps once, so
here they come lazily, with the same parsing, the same checks and the same
error messages (the parsing helpers are runfile's own). ``on_progress`` is
told how many characters were consumed, every :data:`PROGRESS_EVERY` lines,
so a progress bar can follow the file's size without a second pass.

CSV rows go in chunks of :data:`CHUNK_ROWS` lines, a column at a time: the
cells are converted by ``map(int/float)`` over whole columns and validated in
bulk (the steps' range once per chunk, each run id once through the schema),
and the events of a chunk whose every cell is filled are built without a
validator call each (:func:`_built`, what pydantic's ``model_construct`` does,
minus its Python loop over the fields). A chunk with anything unusual in it (an
empty or malformed cell, steps out of order, a bad label, a blank line) goes
row by row through runfile's own rules instead, so the events and the error
messages are runfile's, whichever path read them.
"""

from __future__ import annotations

import csv
import itertools
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator

from spikeguard.lab.runfile import (
    csv_header,
    iter_jsonl,
    _FALSE,
    _FLOAT_COLUMNS,
    _TRUE,
    RunFileError,
    _default_run_id,
    _event,
    _parse_bool,
    _parse_float,
    _parse_int,
)
from spikeguard.schemas import StepEvent
from spikeguard.schemas.events import MAX_COUNTER

PROGRESS_EVERY = 2000
Progress = Callable[[int], None]
_JSONL = (".jsonl", ".ndjson", ".json")


def iter_steps(
    path: str | os.PathLike,
    run_id: str | None = None,
    on_progress: Progress | None = None,
) -> Iterator[StepEvent]:
    """The steps of a CSV or JSONL run file, in file order; bad input raises :class:`RunFileError`."""
    path = Path(path)
    name = str(path)
    try:
        handle = path.open(encoding="utf-8", newline="")
    except OSError as exc:
        raise RunFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    with handle:
        lines = _counted(handle, on_progress)
        suffix = path.suffix.lower()
        if suffix not in _JSONL and suffix != ".csv":  # no extension to go by: sniff
            head: list[str] = []
            for line in lines:
                head.append(line)
                if line.strip():
                    break
            suffix = ".jsonl" if "".join(head).lstrip().startswith("{") else ".csv"
            lines = itertools.chain(head, lines)
        read = _jsonl if suffix in _JSONL else _csv
        yield from read(lines, name, run_id or _default_run_id(path))


def _counted(lines: Iterable[str], on_progress: Progress | None) -> Iterator[str]:
    if on_progress is None:
        yield from lines
        return
    consumed = 0
    for i, line in enumerate(lines, start=1):
        consumed += len(line)
        if i % PROGRESS_EVERY == 0:
            on_progress(consumed)
            consumed = 0
        yield line
    on_progress(consumed)


#: Rows parsed together on the fast path (a few hundred KiB of text at most).
CHUNK_ROWS = 2048
_validate_step = StepEvent.__pydantic_validator__.validate_python  # StepEvent(**f) minus its frame
_BOOLS = _TRUE | _FALSE


class _Columns:
    """Where the header put each column, and the file's default run id."""

    def __init__(self, index: dict[str, int], run_id: str) -> None:
        self.width = max(index.values()) + 1  # cells a row needs (the header's own count)
        self.floats = [(column, index[column]) for column in _FLOAT_COLUMNS if column in index]
        self.step_at, self.loss_at = index["step"], index["loss"]
        self.run_at, self.label_at = index.get("run_id"), index.get("label")
        self.run_id = run_id
        self.last: dict[str, int] = {}  # each run's newest step read so far
        self.checked: set[str] = set()  # run ids the schema has accepted


def _csv(lines: Iterable[str], name: str, run_id: str) -> Iterator[StepEvent]:
    # Chunks of lines go through _chunk, a column at a time (C-speed conversions, the
    # checks once per chunk, no validator call per row). A chunk it cannot vouch for,
    # however little is odd in it, goes through _rows, the row-by-row loop of
    # runfile._read_csv: it yields the same events, and raises the same error at the
    # same line. So the fast path never has to be right about a broken file, only
    # about a clean one, where both give the same values (the same int()/float()
    # parse each cell).
    lines = iter(lines)
    reader = csv.reader(lines)
    columns = _Columns(csv_header(reader, name), run_id)
    line = reader.line_num  # lines read so far
    while True:
        raw = list(itertools.islice(lines, CHUNK_ROWS))
        if not raw:
            return
        if any('"' in text for text in raw):  # quoting: a record may span lines
            yield from _quoted(csv.reader(itertools.chain(raw, lines)), line, columns, name)
            return
        rows = list(csv.reader(raw))  # no quotes: one line, one record
        events = _chunk(rows, columns, columns.last) if all(rows) else None
        if events is None:
            numbers = range(line + 1, line + 1 + len(rows))
            kept = [(row, n) for row, n in zip(rows, numbers) if not _blank(row)]
            yield from _rows(
                [r for r, _ in kept], [n for _, n in kept], columns, name, columns.last
            )
        else:
            yield from events
        line += len(raw)


def _quoted(reader, offset: int, columns: _Columns, name: str) -> Iterator[StepEvent]:
    """The rest of a file with quoted cells: chunks as in _csv, line numbers from the reader."""
    while True:
        rows: list[list[str]] = []
        line_numbers: list[int] = []
        for row in reader:
            if _blank(row):
                continue
            rows.append(row)
            line_numbers.append(offset + reader.line_num)
            if len(rows) == CHUNK_ROWS:
                break
        if not rows:
            return
        events = _chunk(rows, columns, columns.last)
        if events is None:
            yield from _rows(rows, line_numbers, columns, name, columns.last)
        else:
            yield from events


def _blank(row: list[str]) -> bool:
    return not (row and row[0].strip()) and not any(cell.strip() for cell in row)


def _chunk(rows: list[list[str]], c: _Columns, last: dict[str, int]) -> list[StepEvent] | None:
    """The chunk's events, or None when any row needs the careful path (``last`` untouched then)."""
    try:
        if min(map(len, rows)) < c.width:
            return None
        cells = list(zip(*rows))  # columns (cut to the shortest row, which holds them all)
        steps = list(map(int, cells[c.step_at]))
        losses = list(map(float, cells[c.loss_at]))
        optional: list[tuple[str, list[float | None]]] = []
        for column, at in c.floats:
            try:
                optional.append((column, list(map(float, cells[at]))))
            except ValueError:  # empty cells are "not recorded"; anything else is refused
                optional.append((column, [float(v) if v.strip() else None for v in cells[at]]))
    except ValueError:
        return None
    if min(steps) < 0:
        return None
    if c.label_at is not None and not {v.strip().lower() for v in cells[c.label_at]} <= _BOOLS:
        return None
    if c.run_at is None:
        runs = [c.run_id] * len(rows)
    else:
        named = {raw: raw.strip() or c.run_id for raw in set(cells[c.run_at])}
        runs = [named[raw] for raw in cells[c.run_at]]
    newest = _in_order(runs, steps, last)
    if newest is None:
        return None
    base = {"run_id": None, "step": None, "loss": None, "time": None}
    try:
        if all(None not in values for _, values in optional):  # the usual file: every cell filled
            keys = (*base, *(column for column, _ in optional))  # a time column wins, as below
            values = zip(runs, steps, losses, map(float, steps), *(v for _, v in optional))
            if max(steps) > MAX_COUNTER or not _runs_valid(set(runs), c.checked):
                return None
            events = _built(keys, values)
        else:
            events = []
            for i, step in enumerate(steps):
                fields: dict[str, object] = {
                    "run_id": runs[i],
                    "step": step,
                    "loss": losses[i],
                    "time": float(step),
                }
                for column, column_values in optional:
                    value = column_values[i]
                    if value is not None:
                        fields[column] = value
                events.append(_validate_step(fields))
    except ValueError:  # pydantic's ValidationError: _rows names the row and the column
        return None
    last.update(newest)
    return events


# What _built may skip: every other field of a StepEvent takes its default, and the
# ones it sets are a run id (checked once per run), a step (range checked per chunk) and floats.
_DEFAULTS = {
    name: field.get_default(call_default_factory=True)
    for name, field in StepEvent.model_fields.items()
}
_FACTORIES = tuple(
    name for name, field in StepEvent.model_fields.items() if field.default_factory is not None
)
_PLAIN = StepEvent.__pydantic_post_init__ is None and not StepEvent.__private_attributes__


def _runs_valid(runs: set[str], checked: set[str]) -> bool:
    """True when the schema accepts every run id (each validated once per file)."""
    for run in runs - checked:
        try:
            _validate_step({"run_id": run, "step": 0, "loss": 0.0, "time": 0.0})
        except ValueError:
            return False
        checked.add(run)
    return True


def _built(keys: tuple[str, ...], values: Iterable[tuple]) -> list[StepEvent]:
    """StepEvents of already-valid field values, as ``StepEvent.model_construct`` builds them.

    The values are of the declared types (the caller converted and checked them
    in bulk), so the validator would return them unchanged; what it would add
    is the defaults, fresh for the mutable ones. The events compare equal to
    validated ones, with the same ``model_fields_set``.
    """
    if not _PLAIN:  # a schema with a post-init or private attributes: the validator then
        return [_validate_step(dict(zip(keys, row))) for row in values]
    new, setattr_ = object.__new__, object.__setattr__
    template = dict(_DEFAULTS)  # the fields in their declared order, as validated events hold them
    fresh = [name for name in _FACTORIES if name not in keys]
    fields_set = frozenset(keys)
    events = []
    for row in values:
        data = template.copy()
        data.update(zip(keys, row))
        for name in fresh:
            data[name] = _DEFAULTS[name].copy()
        event = new(StepEvent)
        setattr_(event, "__dict__", data)
        setattr_(event, "__pydantic_fields_set__", set(fields_set))
        setattr_(event, "__pydantic_extra__", None)
        setattr_(event, "__pydantic_private__", None)
        events.append(event)
    return events


def _in_order(runs: list[str], steps: list[int], last: dict[str, int]) -> dict[str, int] | None:
    """Each run's newest step once the chunk is in, or None if a run's steps do not increase."""
    first = runs[0]
    if runs.count(first) == len(runs):  # one run (checked at C speed)
        previous = last.get(first)
        if previous is not None and steps[0] <= previous:
            return None
        if not all(map(int.__lt__, steps, steps[1:])):
            return None
        return {first: steps[-1]}
    newest: dict[str, int] = {}
    for run, step in zip(runs, steps):
        previous = newest.get(run, last.get(run))
        if previous is not None and step <= previous:
            return None
        newest[run] = step
    return newest


def _rows(
    rows: list[list[str]], line_numbers: list[int], c: _Columns, name: str, last: dict[str, int]
) -> Iterator[StepEvent]:
    # The loop of runfile._read_csv, yielding instead of collecting.
    for row, line in zip(rows, line_numbers):
        where = f"{name}:{line}"
        if len(row) < c.width:
            raise RunFileError(f"{where}: {len(row)} cells, the header has {c.width}")
        step = _parse_int(row[c.step_at].strip(), where, "step")
        fields: dict[str, object] = {
            "run_id": (row[c.run_at].strip() if c.run_at is not None else "") or c.run_id,
            "step": step,
            "loss": _parse_float(row[c.loss_at].strip(), where, "loss", required=True),
            "time": float(step),
        }
        for column, at in c.floats:
            value = _parse_float(row[at].strip(), where, column)
            if value is not None:
                fields[column] = value
        if c.label_at is not None:  # a backtest ignores labels, but not a broken file
            _parse_bool(row[c.label_at].strip(), where)
        yield _event(fields, where, last)


def _jsonl(lines: Iterable[str], name: str, run_id: str) -> Iterator[StepEvent]:
    # A backtest ignores labels, but still refuses a file whose labels are broken.
    for event, _ in iter_jsonl(lines, name):
        yield event
