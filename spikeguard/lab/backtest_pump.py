"""The backtest's pump without a bus: detectors and fusion driven directly, batch for batch.

:class:`~spikeguard.lab.backtest.OfflinePipeline` runs the stages as Workers
over an embedded bus. For a backtest (steps in, decisions out) the bus only
moves objects from one list to another, and its records, offsets, consumer
groups and per-record metrics cost more than the judging of some detectors.
:class:`DirectPipeline` hands the stages the very batches those Workers
would poll, in the same order:

- a segment's steps go to every detector in batches of :data:`BATCH` (a
  detector's poll), each detector in turn, each batch admitted record by
  record by the stage as the Worker does (a refused step is dropped, as the
  bus pump's DLQ drops it from a backtest);
- the round's verdicts, sorted into input order (the bus pump's stager), go
  to fusion in batches of :data:`BATCH` (fusion's polls);
- at the end, the stages' ``flush`` in the Workers' ``drain`` order.

A batch is the Worker's own transaction (streaming/batch_transaction.py): if
the stage raises, its runs go back to their state before the batch and it is
retried record by record, and only the failing records are dropped, with a log
line naming them. Nothing
here depends on wall time (no idle eviction; fusion's deadlines are out of
reach), so the decisions are those of the bus pump, which
``tests/spikeguard/lab/test_backtest_pump.py`` checks on the same input.
"""

from __future__ import annotations

import logging
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, Callable, Sequence
import time

from spikeguard.errors import RecordRejected
from spikeguard.processors.detector_stage import one_run
from spikeguard.schemas import Decision, StepEvent, Topics, Verdict
from spikeguard.settings import Settings
from spikeguard.streaming.batch_transaction import handle_batch
from spikeguard.streaming.stage import Stage

if TYPE_CHECKING:
    from spikeguard.metrics import Metrics

log = logging.getLogger(__name__)

#: Records a worker takes per poll: the detectors' and fusion's batch (the bus pump's too).
BATCH = 2000
_EVENT = itemgetter(1)
_STEP_KEY = attrgetter("run_id", "epoch", "step")
_STEP = attrgetter("step")
_SAME = attrgetter("run_id", "rank", "epoch", "session")
_RUN_ID = attrgetter("run_id")


def _span(events: Sequence[Any]) -> int | None:
    """How many steps the events span (the last's step minus the first's) when they are
    steps of one run, rank, epoch and session, each after the one before; None otherwise."""
    if not events:
        return None
    try:
        same = list(map(_SAME, events))
        steps = list(map(_STEP, events))
    except AttributeError:  # not all steps (a run's start or end among them)
        return None
    if same.count(same[0]) != len(same) or not all(map(int.__lt__, steps, steps[1:])):
        return None
    return steps[-1] - steps[0]


def _in_order(stage: Stage, span: int | None) -> bool:
    """True when the stage admits steps spanning ``span`` (see :func:`_span`) whatever their
    times, once it admits the first: unsigned (offline), and no further than a trainer may
    jump between two steps at the same time (``max_step_jump``, within ``max_step_gap``), so
    neither the last against the first nor any step against the one before is too far."""
    if span is None or stage.signing_key is not None:
        return False
    return span <= min(getattr(stage, "max_step_gap", -1), getattr(stage, "max_step_jump", -1))


def _by_place(staged: list[Verdict], order: dict[tuple[str, int, int], int]) -> list[Verdict]:
    """``staged`` sorted (stably) by each verdict's step's place in the input."""
    places = list(map(order.get, map(_STEP_KEY, staged), repeat(len(order))))
    return [staged[i] for i in sorted(range(len(staged)), key=places.__getitem__)]


def _step_by_step(
    judged: list[list[Verdict]], steps: Sequence[StepEvent], order: dict[tuple[str, int, int], int]
) -> list[Verdict]:
    """Every detector's verdicts on ``steps`` (``judged``: one list per detector, in detector
    order) in the order fusion reads them: by each step's place in the input, a step's verdicts
    in detector order (:func:`_by_place` over them all, one after the other).

    The usual batch, where every detector judged every step once, in order, and the steps'
    places rise, is that order already taken a step at a time: no sort, no look-up per verdict.
    """
    n = len(steps)
    if all(len(verdicts) == n for verdicts in judged) and one_run(steps):
        places = list(map(order.__getitem__, map(_STEP_KEY, steps)))
        if all(map(int.__lt__, places, places[1:])):
            return [v for step_verdicts in zip(*judged) for v in step_verdicts]
    return _by_place([v for verdicts in judged for v in verdicts], order)


class DirectPipeline:
    """All detectors + fusion over steps, fed segment by segment; decisions out."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics | None = None,
        detectors: Sequence[str] | None = None,
    ) -> None:
        """``detectors``: all by default; fewer to measure what one costs (fusion's
        ``expected`` should then name the same)."""
        from spikeguard.components import DETECTOR_NAMES, build_stage

        self.topics = Topics(settings.topic_prefix)
        self.metrics = metrics  # batch counts only: no per-record work offline
        names = DETECTOR_NAMES if detectors is None else detectors
        self._detectors = [build_stage(name, settings, self.topics) for name in names]
        self._fusion = build_stage("fusion", settings, self.topics)

    def feed(self, steps: Sequence[StepEvent]) -> list[Decision]:
        """Judge ``steps`` (in input order) until every stage is idle; the decisions made."""
        # Where each step stands in the input: verdicts reach fusion in that order (a
        # step given twice keeps its first place, as in the bus pump).
        # Built backwards, so that a key's first place is the one written last (C speed).
        order = dict(zip(map(_STEP_KEY, reversed(steps)), range(len(steps) - 1, -1, -1)))
        topic = self.topics.steps
        decisions: list[Decision] = []
        for start in range(0, len(steps), BATCH):
            batch = steps[start : start + BATCH]
            items = list(zip(repeat(topic), batch))
            # What every detector's admission and transaction would work out alike, once.
            span, run_ids = _span(batch), set(map(_RUN_ID, batch))
            judged = []
            for stage in self._detectors:
                admitted = self._admitted(stage, items, span)
                whole = run_ids if admitted is items else None
                judged.append(list(map(_EVENT, self._run(stage, admitted, whole))))
            decisions += self._fuse(_step_by_step(judged, batch, order), {})
        return decisions

    def finish(self) -> list[Decision]:
        """End of input: the stages emit what they still hold (the Workers' drain, in order)."""
        decisions: list[Decision] = []
        while True:
            for stage in (*self._detectors, self._fusion):
                out = stage.flush()
                if out:  # the bus pump runs a round after the first drain that emits
                    break
            else:
                return decisions
            events = list(map(_EVENT, out))
            if stage is self._fusion:
                decisions += events  # type: ignore[arg-type]
            else:
                decisions += self._fuse(events, {})  # type: ignore[arg-type]

    # -- one round ------------------------------------------------------------
    def _fuse(
        self, staged: list[Verdict], order: dict[tuple[str, int, int], int]
    ) -> list[Decision]:
        """Fusion's batches of ``staged``, sorted (stably) by input position when ``order``
        gives one (the pump's stager), the look-ups at C speed."""
        if order:
            staged = _by_place(staged, order)
        topic = self.topics.verdicts
        fusion = self._fusion
        decisions: list[Any] = []
        for start in range(0, len(staged), BATCH):
            items = list(zip(repeat(topic), staged[start : start + BATCH]))
            decisions += map(_EVENT, self._run(fusion, items))
        decisions += map(_EVENT, fusion.tick(time.time()))  # the Worker ticks after each poll
        return decisions

    def _admitted(
        self, stage: Stage, items: list[tuple[str, Any]], span: int | None
    ) -> list[tuple[str, Any]]:
        """The items the stage admits (out-of-order steps are refused, as the Worker refuses
        them); ``span``: :func:`_span` of their events."""
        admit = getattr(stage, "admit", None)
        if admit is None:
            return items
        if _in_order(stage, span):
            # Each step is after the one before it, none too far: admitting the first and
            # the last is admitting them all, with the same state after.
            try:
                admit(*items[0])
            except RecordRejected:
                pass  # the first is refused: record by record, which refuses it again
            else:
                try:
                    if len(items) > 1:
                        admit(*items[-1])
                    return items
                except RecordRejected:  # not expected (see _in_order): the rest one by one
                    return [items[0], *self._one_by_one(stage, admit, items[1:])]
        return self._one_by_one(stage, admit, items)

    def _one_by_one(
        self, stage: Stage, admit: Callable[[str, Any], None], items: list[tuple[str, Any]]
    ) -> list[tuple[str, Any]]:
        """The items ``admit`` takes, each admitted in turn (the Worker's way)."""
        kept = []
        for item in items:
            try:
                admit(*item)
            except RecordRejected as exc:
                log.warning(
                    "%s: %s step %s dropped: %s", stage.name, item[1].run_id, item[1].step, exc
                )
                self._count(stage, "dead_letters", type(exc).__name__)
                continue
            kept.append(item)
        return kept

    def _run(
        self, stage: Stage, items: list[tuple[str, Any]], run_ids: set[str] | None = None
    ) -> list[tuple[str, Any]]:
        """``stage.handle_batch(items)`` as the Worker's transaction (streaming/batch_transaction.py);
        ``run_ids``: the items' runs, when the caller has them."""
        if not items:
            return []
        self._count(stage, "records_in", items[0][0], len(items))

        def failed(index: int, exc: Exception) -> None:
            event = items[index][1]
            log.exception(
                "%s: %s step %s failed; dropped",
                stage.name,
                event.run_id,
                getattr(event, "step", None),
            )
            self._count(stage, "dead_letters", "StageError")

        return handle_batch(stage, items, failed, run_ids=run_ids)

    def _count(self, stage: Stage, metric: str, label: str, n: int = 1) -> None:
        if self.metrics is not None:
            getattr(self.metrics, metric).labels(stage.name, label).inc(n)
