"""A run file's steps one at a time, for a backtest whose memory must not grow with the file.

:func:`spikeguard.lab.runfile.read_steps` returns whole lists (evaluation
needs the labels beside the steps); a backtest only walks the steps once, so
here they come lazily, with the same parsing, the same checks and the same
error messages (the parsing helpers are runfile's own). ``on_progress`` is
told how many characters were consumed, every :data:`PROGRESS_EVERY` lines,
so a progress bar can follow the file's size without a second pass.

The csv module is used as is: parsing and validating a row costs ~10 µs,
against ~100 µs for the pipeline to judge it, so a numpy reader would save
nothing measurable and would have to reproduce runfile's rules a second time.
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
    _FLOAT_COLUMNS,
    RunFileError,
    _default_run_id,
    _event,
    _parse_bool,
    _parse_float,
    _parse_int,
)
from spikeguard.schemas import StepEvent

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


def _csv(lines: Iterable[str], name: str, run_id: str) -> Iterator[StepEvent]:
    # The loop of runfile._read_csv, yielding instead of collecting.
    reader = csv.reader(lines)
    index = csv_header(reader, name)
    width = max(index.values()) + 1  # cells a row needs (the header's own count)
    floats = [(column, index[column]) for column in _FLOAT_COLUMNS if column in index]
    step_at, loss_at = index["step"], index["loss"]
    run_at, label_at = index.get("run_id"), index.get("label")
    last: dict[str, int] = {}
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue
        where = f"{name}:{reader.line_num}"
        if len(row) < width:
            raise RunFileError(f"{where}: {len(row)} cells, the header has {width}")
        step = _parse_int(row[step_at].strip(), where, "step")
        fields: dict[str, object] = {
            "run_id": (row[run_at].strip() if run_at is not None else "") or run_id,
            "step": step,
            "loss": _parse_float(row[loss_at].strip(), where, "loss", required=True),
            "time": float(step),
        }
        for column, at in floats:
            value = _parse_float(row[at].strip(), where, column)
            if value is not None:
                fields[column] = value
        if label_at is not None:  # a backtest ignores labels, but not a broken file
            _parse_bool(row[label_at].strip(), where)
        yield _event(fields, where, last)


def _jsonl(lines: Iterable[str], name: str, run_id: str) -> Iterator[StepEvent]:
    # A backtest ignores labels, but still refuses a file whose labels are broken.
    for event, _ in iter_jsonl(lines, name):
        yield event
