"""The detector stage: steps in, one detector per run, verdicts out."""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Callable, Sequence

from pydantic import BaseModel

from spikeguard.processors.detectors.base import Detector
from spikeguard.schemas import StepEvent, Topics, Verdict
from spikeguard.streaming.stage import Output, PerRunStage, group_by_run

_EVENT = itemgetter(1)
_RUN_ID = attrgetter("run_id")


def one_run(events: list) -> bool:
    """True when every event (at least one) is of the same run (checked at C speed)."""
    if not events:
        return False
    run_ids = list(map(_RUN_ID, events))
    return run_ids.count(run_ids[0]) == len(run_ids)


class DetectorStage(PerRunStage[Detector]):
    """steps -> verdicts, with one detector per run fed whole batches (ML scores in bulk)."""

    def __init__(self, topics: Topics, name: str, factory: Callable[[str], Detector]) -> None:
        super().__init__(topics, factory)
        self.name = name

    def inputs(self) -> dict[str, type[BaseModel]]:
        return {self.topics.steps: StepEvent}

    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        events = list(map(_EVENT, items))
        if one_run(events):  # the usual batch: no need to regroup
            verdicts = with_values(self.run(events[0].run_id).update_many(events), events)  # type: ignore[attr-defined]
        else:
            verdicts = []
            for run_id, run_events in group_by_run(events).items():
                verdicts += with_values(self.run(run_id).update_many(run_events), run_events)
        return list(zip(repeat(self.topics.verdicts), verdicts))


def with_values(verdicts: list[Verdict], events: Sequence[StepEvent]) -> list[Verdict]:
    """Each verdict with its step's loss and gradient norm: fusion's evidence comes from them."""
    return [
        v if v.loss is not None else v.model_copy(update={"loss": e.loss, "grad_norm": e.grad_norm})
        for v, e in zip(verdicts, events)
    ]
