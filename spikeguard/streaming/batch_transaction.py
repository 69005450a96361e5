"""A batch as a transaction on the state of its runs, retried record by record when it fails.

The worker loop and the offline pump (spikeguard/lab/backtest_pump.py) both hand
a stage its batches through :func:`handle_batch`, so a backtest judges a failing
record exactly as a deployed worker does:

- the stage's :meth:`~spikeguard.streaming.stage.Stage.undo_point` of the
  batch's runs is taken before the batch;
- if the stage raises, those runs go back to it (runs the batch created are
  dropped), and the batch is handed over again one record at a time, each with
  its own undo point;
- a record that still fails leaves no effect behind, and the caller is told
  which one and why (the worker sends it to the DLQ; the pump counts and drops it).

What the stage made of the records that went through is returned in their order.
"""

from __future__ import annotations

import logging
from operator import attrgetter, itemgetter
from typing import Any, Callable, Sequence

from pydantic import BaseModel

from spikeguard.streaming.stage import Output, Stage

log = logging.getLogger(__name__)

_RUN_ID = attrgetter("run_id")
_EVENT = itemgetter(1)

#: Told of a record that failed on its own: its index in the batch and what the stage raised.
#: Called inside the ``except`` block, after the record's run was put back.
RecordFailed = Callable[[int, Exception], None]


def handle_batch(
    stage: Stage,
    items: Sequence[tuple[str, BaseModel]],
    on_failure: RecordFailed,
    name: str | None = None,
    run_ids: set[str] | None = None,
) -> list[Output]:
    """``stage.handle_batch(items)`` as one transaction; on failure, record by record.

    ``name`` labels the log line of a failed batch (default: the stage's name);
    ``run_ids`` are the items' runs when the caller has them already.
    """
    if run_ids is None:
        run_ids = set(map(_RUN_ID, map(_EVENT, items)))
    before = stage.undo_point(run_ids)
    try:
        return stage.handle_batch(items)
    except Exception:
        log.exception("%s: batch failed; retrying record by record", name or stage.name)
    rewind(stage, run_ids, before)
    outputs: list[Output] = []
    for index, item in enumerate(items):
        run_ids = {_RUN_ID(item[1])}
        before = stage.undo_point(run_ids)
        try:
            outputs += stage.handle_batch([item])
        except Exception as exc:  # noqa: BLE001 - whatever one record raises, it alone is refused
            rewind(stage, run_ids, before)
            on_failure(index, exc)
    return outputs


def rewind(stage: Stage, run_ids: set[str], before: dict[str, Any]) -> None:
    """Put these runs' state back to ``before`` (runs it lacks did not exist yet)."""
    stage.forget(run_ids - before.keys())
    stage.restore(before)
