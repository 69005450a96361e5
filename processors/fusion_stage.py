"""The fusion stage: verdicts in, one fusion per run, decisions out."""

from __future__ import annotations

import time
from itertools import repeat
from operator import itemgetter
from typing import Sequence

from pydantic import BaseModel

from spikeguard.processors.detector_stage import one_run
from spikeguard.schemas import Topics, Verdict
from spikeguard.streaming.stage import Output, PerRunStage

_EVENT = itemgetter(1)


class FusionStage(PerRunStage):
    """verdicts -> one decision per step, deadlines checked on every tick."""

    name = "fusion"

    def inputs(self) -> dict[str, type[BaseModel]]:
        return {self.topics.verdicts: Verdict}

    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        now = time.time()
        verdicts = list(map(_EVENT, items))
        if one_run(verdicts):  # the usual batch: one call for all of it
            decisions = self.run(verdicts[0].run_id).add_many(verdicts, now)  # type: ignore[attr-defined]
        else:  # in arrival order across runs, as decisions must leave
            decisions = []
            for verdict in verdicts:
                decisions += self.run(verdict.run_id).add(verdict, now)  # type: ignore[attr-defined]
        return list(zip(repeat(self.topics.decisions), decisions))

    def tick(self, now: float) -> list[Output]:
        topic = self.topics.decisions
        return [(topic, d) for fusion in self.runs.values() for d in fusion.tick(now)]

    def flush(self) -> list[Output]:
        topic = self.topics.decisions
        return [(topic, d) for fusion in self.runs.values() for d in fusion.flush()]
