"""The fusion stage: verdicts in, one fusion per run, decisions out."""

from __future__ import annotations

import time
from collections import Counter
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Callable, Sequence

from pydantic import BaseModel

from spikeguard.processors.detector_stage import one_run
from spikeguard.processors.fusion import Fusion
from spikeguard.schemas import Topics, Verdict
from spikeguard.streaming.stage import Output, PerRunStage

_EVENT = itemgetter(1)
# What a fusion drops on purpose, counted per run; the stage exports the increments.
_IGNORED = attrgetter("late_verdicts", "stale_verdicts", "duplicate_verdicts")
_REASONS = ("late_verdict", "stale_verdict", "duplicate_verdict")


class FusionStage(PerRunStage):
    """verdicts -> one decision per step, deadlines checked on every tick."""

    name = "fusion"

    def __init__(self, topics: Topics, factory: Callable[[str], Fusion]) -> None:
        super().__init__(topics, factory)
        self._ignored: Counter[str] = Counter()

    def inputs(self) -> dict[str, type[BaseModel]]:
        return {self.topics.verdicts: Verdict}

    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        now = time.time()
        verdicts = list(map(_EVENT, items))
        if one_run(verdicts):  # the usual batch: one call for all of it
            fusion = self.run(verdicts[0].run_id)
            before = _IGNORED(fusion)
            decisions = fusion.add_many(verdicts, now)  # type: ignore[attr-defined]
            self._tally(before, _IGNORED(fusion))
        else:  # in arrival order across runs, as decisions must leave
            decisions = []
            touched: dict[str, tuple] = {}
            for verdict in verdicts:
                fusion = self.run(verdict.run_id)
                if verdict.run_id not in touched:
                    touched[verdict.run_id] = (fusion, _IGNORED(fusion))
                decisions += fusion.add(verdict, now)  # type: ignore[attr-defined]
            for fusion, before in touched.values():
                self._tally(before, _IGNORED(fusion))
        return list(zip(repeat(self.topics.decisions), decisions))

    def _tally(self, before: tuple[int, ...], after: tuple[int, ...]) -> None:
        if before != after:
            for reason, was, now in zip(_REASONS, before, after):
                if now > was:
                    self._ignored[reason] += now - was

    def drain_ignored(self) -> dict[str, int]:
        out = dict(self._ignored)
        self._ignored.clear()
        return out

    def tick(self, now: float) -> list[Output]:
        topic = self.topics.decisions
        return [(topic, d) for fusion in self.runs.values() for d in fusion.tick(now)]

    def flush(self) -> list[Output]:
        topic = self.topics.decisions
        return [(topic, d) for fusion in self.runs.values() for d in fusion.flush()]
