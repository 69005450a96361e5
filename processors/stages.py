"""The pipeline's processing stages: detectors and fusion, one object per run."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from pydantic import BaseModel

from spikeguard.processors.detectors.base import Detector
from spikeguard.processors.stage import Output, PerRunStage, group_by_run
from spikeguard.schemas import StepEvent, Topics, Verdict


class DetectorStage(PerRunStage[Detector]):
    """steps -> verdicts, with one detector per run fed whole batches (ML scores in bulk)."""

    def __init__(self, topics: Topics, name: str, factory: Callable[[str], Detector]) -> None:
        super().__init__(topics, factory)
        self.name = name

    def inputs(self) -> dict[str, type[BaseModel]]:
        return {self.topics.steps: StepEvent}

    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        topic = self.topics.verdicts
        out: list[Output] = []
        for run_id, events in group_by_run([event for _, event in items]).items():
            out.extend((topic, verdict) for verdict in self.run(run_id).update_many(events))
        return out


class FusionStage(PerRunStage):
    """verdicts -> one decision per step, deadlines checked on every tick."""

    name = "fusion"

    def inputs(self) -> dict[str, type[BaseModel]]:
        return {self.topics.verdicts: Verdict}

    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        now = time.time()
        topic = self.topics.decisions
        out: list[Output] = []
        for _, verdict in items:
            out.extend((topic, d) for d in self.run(verdict.run_id).add(verdict, now))  # type: ignore[attr-defined]
        return out

    def tick(self, now: float) -> list[Output]:
        topic = self.topics.decisions
        return [(topic, d) for fusion in self.runs.values() for d in fusion.tick(now)]

    def flush(self) -> list[Output]:
        topic = self.topics.decisions
        return [(topic, d) for fusion in self.runs.values() for d in fusion.flush()]
