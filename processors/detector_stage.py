"""The detector stage: steps in, one detector per run, verdicts out.

Before a step is judged, :meth:`DetectorStage.admit` refuses two kinds of
record, which the worker sends to the DLQ with the reason:

- with a signing key, a step without the trainer's valid signature
  (:class:`~spikeguard.errors.StepNotAuthenticated`): otherwise anyone who can
  write to the steps topic could make the pipeline sign actions for a run.
  The verdicts it publishes are signed in turn (by the worker, with the
  detectors' key), and fusion takes no others;
- a step at or before one already admitted for the same run and rank in the
  same epoch, or from an older epoch (:class:`~spikeguard.errors.StepOutOfOrder`):
  a partition keeps a run's records in order, so such a step is a replay (a
  trainer resumed from a checkpoint re-sends steps already judged) or forged;
  fusion would only drop its verdicts. A rollback starts a new epoch, so its
  re-run steps are admitted. The memory of the newest step is not part of the
  snapshot: after a restart the replayed records are the ones to judge again;
- a step more than ``max_step_gap`` steps past the newest admitted one of its
  epoch, or an epoch more than ``max_epoch_gap`` past the newest
  (:class:`~spikeguard.errors.StepOutOfOrder`): without a key (``--insecure``)
  one forged far-future step would otherwise make every genuine step after it
  look like a replay. A run's first step may be any step (a resumed run).

Steps and epochs themselves are bounded by the schema (below 2**53).

The stage also reads the compacted ``runs`` topic: with a signing key, a run
event not signed with it is refused like a step
(:class:`~spikeguard.errors.RunEventNotAuthenticated`); a run's end (the Guard's
``RunEvent`` of kind ``end``) drops its detector (:meth:`end_runs`; the worker
tombstones its saved state and removes its metric series). The end and the
run's last steps travel on different topics, so the end may be read first: the
run is then ended once its step ``end.step - 1`` (of the end's epoch) has been
judged, never before; a run whose last steps never come is evicted by the
worker's idle TTL.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Callable, Sequence

from pydantic import BaseModel, SecretStr

from spikeguard.errors import StepOutOfOrder
from spikeguard.processors.detectors.base import Detector
from spikeguard.schemas import RunEvent, StepEvent, Topics, Verdict
from spikeguard.schemas.signing import authenticate
from spikeguard.streaming.run_clock import DEFAULT_MAX_EPOCH_GAP, DEFAULT_MAX_STEP_GAP
from spikeguard.streaming.stage import Output, PerRunStage, group_by_run

_TOPIC = itemgetter(0)
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

    def __init__(
        self,
        topics: Topics,
        name: str,
        factory: Callable[[str], Detector],
        signing_key: SecretStr | None = None,
        max_step_gap: int = DEFAULT_MAX_STEP_GAP,
        max_epoch_gap: int = DEFAULT_MAX_EPOCH_GAP,
    ) -> None:
        super().__init__(topics, factory)
        self.name = name
        self.signing_key = signing_key
        # A trainer publishes every step; its queue drops at most ~10k when the bus is away.
        self.max_step_gap = max_step_gap
        self.max_epoch_gap = max_epoch_gap  # one epoch per rollback
        # run_id -> rank -> (epoch, step) of the newest admitted step.
        self._newest: dict[str, dict[int, tuple[int, int]]] = {}
        # run_id -> (epoch, step) of the newest step judged, and of the last step of a
        # run whose end was read before that step was judged.
        self._judged: dict[str, tuple[int, int]] = {}
        self._ending: dict[str, tuple[int, int]] = {}

    def admit(self, topic: str, event: StepEvent) -> None:
        """Raise a StepRejected subclass naming why ``event`` must not be judged."""
        # A step steers the pipeline, an end drops the run's state: only the run's own.
        authenticate(event, self.signing_key)
        if isinstance(event, RunEvent):
            return  # not a step: nothing to order here
        ranks = self._newest.setdefault(event.run_id, {})
        here = (event.epoch, event.step)
        last = ranks.get(event.rank)
        if last is not None and here <= last:
            raise StepOutOfOrder(
                f"run {event.run_id} rank {event.rank}: step {event.step} of epoch {event.epoch} "
                f"is not after step {last[1]} of epoch {last[0]}, already judged "
                "(a replay or forged; a rollback would have started a new epoch)"
            )
        if last is not None:
            if event.epoch == last[0] and event.step - last[1] > self.max_step_gap:
                raise StepOutOfOrder(
                    f"run {event.run_id} rank {event.rank}: step {event.step} of epoch {event.epoch} "
                    f"is more than {self.max_step_gap} steps past step {last[1]}, the newest judged "
                    "(far future: forged or corrupt)"
                )
            if event.epoch - last[0] > self.max_epoch_gap:
                raise StepOutOfOrder(
                    f"run {event.run_id} rank {event.rank}: epoch {event.epoch} is more than "
                    f"{self.max_epoch_gap} epochs past epoch {last[0]}, the newest judged "
                    "(far future: forged or corrupt)"
                )
        ranks[event.rank] = here

    def restore(self, state: dict) -> None:
        # A restored run is judged again from its snapshot's offsets: those replays are not
        # out of order, so its newest admitted step starts over.
        super().restore(state)
        for run_id in state:
            self._newest.pop(run_id, None)

    def forget(self, run_ids) -> None:  # type: ignore[no-untyped-def]
        run_ids = list(run_ids)
        super().forget(run_ids)
        for run_id in run_ids:
            self._newest.pop(run_id, None)
            self._judged.pop(run_id, None)
            self._ending.pop(run_id, None)

    def shrink(self) -> None:
        super().shrink()
        self._newest, self._judged, self._ending = (
            dict(self._newest),
            dict(self._judged),
            dict(self._ending),
        )

    def inputs(self) -> dict[str, type[BaseModel]]:
        return {self.topics.steps: StepEvent, self.topics.runs: RunEvent}

    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        if self.topics.runs not in map(_TOPIC, items):  # the usual batch: steps only
            return self._judge(list(map(_EVENT, items)))
        out: list[Output] = []
        steps: list[StepEvent] = []
        for topic, event in items:  # in order: a run's end comes after the steps before it
            if topic != self.topics.runs:
                steps.append(event)  # type: ignore[arg-type]
                continue
            if steps:
                out += self._judge(steps)
                steps = []
            self._on_run_event(event)  # type: ignore[arg-type]
        if steps:
            out += self._judge(steps)
        return out

    def _judge(self, events: list[StepEvent]) -> list[Output]:
        if one_run(events):  # the usual batch: no need to regroup
            verdicts = with_values(self.run(events[0].run_id).update_many(events), events)  # type: ignore[attr-defined]
            self._judged[events[0].run_id] = (events[-1].epoch, events[-1].step)
        else:
            verdicts = []
            for run_id, run_events in group_by_run(events).items():
                verdicts += with_values(self.run(run_id).update_many(run_events), run_events)
                self._judged[run_id] = (run_events[-1].epoch, run_events[-1].step)  # type: ignore[attr-defined]
        if self._ending:
            self.end_runs(
                [
                    run_id
                    for run_id, last in self._ending.items()
                    if self._judged.get(run_id, (-1, -1)) >= last
                ]
            )
        return list(zip(repeat(self.topics.verdicts), verdicts))

    def _on_run_event(self, event: RunEvent) -> None:
        if event.kind != "end":
            return
        last = (event.epoch, event.step - 1)
        if event.run_id in self.runs and self._judged.get(event.run_id, (-1, -1)) < last:
            self._ending[event.run_id] = last  # its last steps are still on their way
        else:
            self.end_runs([event.run_id])


def with_values(verdicts: list[Verdict], events: Sequence[StepEvent]) -> list[Verdict]:
    """Each verdict with its step's loss and gradient norm: fusion's evidence comes from them."""
    return [
        v if v.loss is not None else v.model_copy(update={"loss": e.loss, "grad_norm": e.grad_norm})
        for v, e in zip(verdicts, events)
    ]
