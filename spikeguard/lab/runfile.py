"""Run files: a run's steps (and optional labels) as CSV or JSONL.

CSV (``.csv``, or gzip-compressed ``.csv.gz``): a header naming at least ``step,loss``; optional columns ``grad_norm``,
``lr``, ``update_norm``, ``run_id``, ``time``, ``label``, ``kind`` (any other
column is ignored). Non-finite values are written ``nan``, ``inf``, ``-inf``
(``NaN``/``Infinity`` are read too); an empty cell is "not recorded". Without
a ``time`` column the clock is synthetic (one second per step), so a backtest
of the same file is the same every time. JSONL: one :class:`StepEvent` per
line (optional ``label``/``kind`` keys on the same object).

Labels come back only when the file has a ``label`` column (or key): a
``StepLabel(label, kind)`` per step, ``kind`` "" for clean steps.
Bad input raises :class:`RunFileError` naming the file, line and column.

>>> import io
>>> events, labels = read_steps(io.StringIO("step,loss\\n0,2.5\\n1,nan\\n"), run_id="r")
>>> [e.loss for e in events], labels
([2.5, nan], None)
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
import re
from pathlib import Path
from typing import IO, Iterable, NamedTuple, Sequence

from spikeguard.errors import SchemaError, SpikeguardError
from spikeguard.schemas import StepEvent, decode

#: Columns :func:`write_csv` writes, in this order (``update_norm`` and ``time`` follow when present).
CSV_COLUMNS = ("step", "loss", "grad_norm", "lr", "run_id", "label", "kind")
_FLOAT_COLUMNS = ("grad_norm", "lr", "update_norm", "time")
_TRUE = {"1", "true", "yes", "y", "t"}
_FALSE = {"0", "false", "no", "n", "f", ""}


class RunFileError(SpikeguardError, ValueError):
    """A run file could not be read; the message names the file, line and column."""


class StepLabel(NamedTuple):
    """Ground truth for one step: inside an anomaly episode or not, and what kind."""

    label: bool
    kind: str = ""


Source = str | os.PathLike | IO[str]


def read_steps(
    source: Source, run_id: str | None = None
) -> tuple[list[StepEvent], list[StepLabel] | None]:
    """Steps (and labels, if the file has them) of a CSV or JSONL run file.

    ``run_id`` names runs whose rows carry none (default: the file's stem).
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        plain = plain_path(path)
        try:
            with open_text(path) as handle:
                return _read(handle, str(path), run_id or _default_run_id(plain), plain.suffix)
        except OSError as exc:
            raise RunFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    name = getattr(source, "name", "<stream>")
    return _read(source, str(name), run_id or "run", Path(str(name)).suffix)


def plain_path(path: Path) -> Path:
    """``path`` without a ``.gz`` suffix: ``run.csv.gz`` is read as ``run.csv``."""
    return path.with_suffix("") if path.suffix.lower() == ".gz" else path


def open_text(path: str | os.PathLike) -> IO[str]:
    """A run file opened for reading as text; a ``.gz`` one is decompressed on the fly."""
    path = Path(path)
    if path.suffix.lower() == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return path.open(encoding="utf-8", newline="")


def write_csv(
    target: str | os.PathLike | IO[str],
    events: Sequence[StepEvent],
    labels: Sequence[StepLabel] | None = None,
) -> None:
    """Write ``events`` (and ``labels``) as CSV that :func:`read_steps` reads back exactly."""
    if labels is not None and len(labels) != len(events):
        raise ValueError(f"{len(labels)} labels for {len(events)} events")
    columns = list(CSV_COLUMNS if labels is not None else CSV_COLUMNS[:5])
    if any(e.update_norm is not None for e in events):
        columns.append("update_norm")
    columns.append("time")
    if isinstance(target, (str, os.PathLike)):
        with open(target, "w", encoding="utf-8", newline="") as handle:
            _write(handle, columns, events, labels)
    else:
        _write(target, columns, events, labels)


def format_float(value: float | None) -> str:
    """``nan``/``inf``/``-inf`` for non-finite values, the shortest exact repr otherwise."""
    if value is None:
        return ""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(float(value))


def _write(handle: IO[str], columns: list[str], events, labels) -> None:
    out = csv.writer(handle, lineterminator="\n")
    out.writerow(columns)
    for i, event in enumerate(events):
        row: list[str] = []
        for column in columns:
            if column == "step":
                row.append(str(event.step))
            elif column == "run_id":
                row.append(event.run_id)
            elif column == "label":
                row.append("1" if labels[i].label else "0")
            elif column == "kind":
                row.append(labels[i].kind)
            else:
                row.append(format_float(getattr(event, column)))
        out.writerow(row)


def _read(handle: IO[str], name: str, run_id: str, suffix: str):
    if suffix.lower() in (".jsonl", ".ndjson", ".json"):
        return _read_jsonl(handle, name, run_id)
    if suffix.lower() == ".csv":
        return _read_csv(handle, name, run_id)
    text = handle.read()  # no extension to go by: sniff the first character
    if text.lstrip().startswith("{"):
        return _read_jsonl(io.StringIO(text), name, run_id)
    return _read_csv(io.StringIO(text), name, run_id)


def csv_header(reader, name: str) -> dict[str, int]:
    """Column name -> position, from the first non-blank row; at least step and loss."""
    header = next(reader, None)
    while header is not None and not any(cell.strip() for cell in header):
        header = next(reader, None)
    if header is None:
        raise RunFileError(f"{name}: empty file (expected a CSV header with at least step,loss)")
    columns = [cell.strip().lower() for cell in header]
    missing = [c for c in ("step", "loss") if c not in columns]
    if missing:
        raise RunFileError(
            f"{name}:{reader.line_num}: header {header!r} lacks {', '.join(missing)} "
            "(a run file needs at least step,loss)"
        )
    return {column: i for i, column in enumerate(columns)}


def _read_csv(handle: IO[str], name: str, run_id: str):
    reader = csv.reader(handle)
    index = csv_header(reader, name)
    width = max(index.values()) + 1  # cells a row needs (the header's own count)
    has_labels = "label" in index
    events: list[StepEvent] = []
    labels: list[StepLabel] = []
    last: dict[str, int] = {}
    for row in reader:
        if not any(cell.strip() for cell in row):
            continue
        where = f"{name}:{reader.line_num}"
        if len(row) < width:
            raise RunFileError(f"{where}: {len(row)} cells, the header has {width}")

        def cell(column: str, row: list[str] = row) -> str:
            return row[index[column]].strip() if column in index else ""

        step = _parse_int(cell("step"), where, "step")
        fields: dict[str, object] = {
            "run_id": cell("run_id") or run_id,
            "step": step,
            "loss": _parse_float(cell("loss"), where, "loss", required=True),
            "time": float(step),
        }
        for column in _FLOAT_COLUMNS:
            value = _parse_float(cell(column), where, column)
            if value is not None:
                fields[column] = value
        events.append(_event(fields, where, last))
        if has_labels:
            labels.append(StepLabel(_parse_bool(cell("label"), where), cell("kind")))
    return events, (labels if has_labels else None)


def _read_jsonl(handle: Iterable[str], name: str, run_id: str):
    events: list[StepEvent] = []
    labels: list[StepLabel] = []
    for event, label in iter_jsonl(handle, name):
        events.append(event)
        if label is not None:
            labels.append(label)
    return events, (labels if labels else None)


def iter_jsonl(lines: Iterable[str], name: str):
    """(event, its label or None) per non-blank line, checked as it is read.

    Labels are all or nothing: once the first line has one, every line needs one.
    """
    labelled: bool | None = None
    last: dict[str, tuple[int, int]] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            event = decode(line, StepEvent)
        except SchemaError as exc:
            raise RunFileError(f"{where}: {exc}") from None
        _check_epoch_order(event, where, last)
        if labelled is None:
            labelled = '"label"' in line
        label = None
        if labelled:
            raw = json.loads(line)
            if "label" not in raw:
                raise RunFileError(f"{where}: no 'label' key (earlier lines have one)")
            label = StepLabel(bool(raw["label"]), str(raw.get("kind") or ""))
        yield event, label


def _event(fields: dict[str, object], where: str, last: dict[str, int]) -> StepEvent:
    try:
        event = StepEvent(**fields)
    except ValueError as exc:  # pydantic ValidationError is a ValueError
        raise RunFileError(f"{where}: {_first_error(exc)}") from None
    _check_order(event.run_id, event.step, where, last)
    return event


def _check_order(run: str, step: int, where: str, last: dict[str, int]) -> None:
    previous = last.get(run)
    if previous is not None and step <= previous:
        raise RunFileError(
            f"{where}: step {step} of run {run!r} comes after step {previous} "
            "(steps must increase within a run)"
        )
    last[run] = step


def _check_epoch_order(event: StepEvent, where: str, last: dict[str, tuple[int, int]]) -> None:
    """Steps increase within an epoch; a rollback opens the next epoch, whose steps go back to
    the checkpoint's (a recorded run with rollbacks is a run, not a disorder in the file)."""
    run, previous = event.run_id, last.get(event.run_id)
    if previous is not None and event.epoch < previous[0]:
        raise RunFileError(
            f"{where}: epoch {event.epoch} of run {run!r} comes after epoch {previous[0]} "
            "(a run's epochs never go back: each rollback opens the next)"
        )
    if previous is not None and event.epoch == previous[0]:
        _check_order(run, event.step, where, {run: previous[1]})
    last[run] = (event.epoch, event.step)


def _parse_float(text: str, where: str, column: str, required: bool = False) -> float | None:
    if not text:
        if required:
            raise RunFileError(f"{where}: column {column!r} is empty")
        return None
    try:
        return float(text)
    except ValueError:
        raise RunFileError(f"{where}: column {column!r}: {text!r} is not a number") from None


def _parse_int(text: str, where: str, column: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise RunFileError(f"{where}: column {column!r}: {text!r} is not an integer") from None
    if value < 0:
        raise RunFileError(f"{where}: column {column!r}: {value} is negative")
    return value


def _parse_bool(text: str, where: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise RunFileError(f"{where}: column 'label': {text!r} is not 0/1/true/false")


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors(include_url=False)[0]
        return f"column {'.'.join(map(str, first['loc']))!r}: {first['msg']}"
    return str(exc)


def _default_run_id(path: Path) -> str:
    return re.sub(r"[\s\x00-\x1f]+", "_", path.stem)[:200] or "run"
