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
- a step further past the newest admitted one of its epoch than a trainer
  runs (``max_step_jump`` steps, plus ``max_steps_per_s`` for every second
  between the two steps' times, the newer one's time taken as at most a few
  seconds ahead of this worker's clock; never more than ``max_step_gap``), or
  an epoch more than ``max_epoch_gap`` past the newest
  (:class:`~spikeguard.errors.StepOutOfOrder`): one far-future step, forged
  without a key (``--insecure``) or by a holder of the trainer key (every
  detector host holds it, to check steps), would otherwise make every genuine
  step after it look like a replay. A run's first step may be any step (a
  resumed run);
- a step of another trainer session than the run's (an earlier run of the
  same run id, replayed: :class:`~spikeguard.errors.RecordOfOtherSession`); a
  step or start of a newer session starts the run's detector afresh
  (:mod:`spikeguard.streaming.run_sessions`).

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

import time
from functools import partial
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Callable, Sequence

from pydantic import BaseModel, SecretStr

from spikeguard.errors import StepOutOfOrder
from spikeguard.processors.detectors.base import Detector
from spikeguard.schemas import RunEvent, StepEvent, Topics, Verdict
from spikeguard.schemas.signing import authenticate, describe
from spikeguard.streaming.run_clock import (
    DEFAULT_MAX_EPOCH_GAP,
    DEFAULT_MAX_STEP_GAP,
    DEFAULT_MAX_STEP_JUMP,
    DEFAULT_MAX_STEPS_PER_S,
    MAX_CLOCK_AHEAD_S,
)
from spikeguard.streaming.run_sessions import SessionTable
from spikeguard.streaming.stage import Output, PerRunStage, group_by_run

_TOPIC = itemgetter(0)
_EVENT = itemgetter(1)
_RUN_ID = attrgetter("run_id")


def one_run(events: Sequence[BaseModel]) -> bool:
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
        max_step_jump: int = DEFAULT_MAX_STEP_JUMP,
        max_steps_per_s: float = DEFAULT_MAX_STEPS_PER_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(topics, factory)
        self.name = name
        # A step ahead of the newest by more than max_step_jump + max_steps_per_s * (seconds
        # between their times) is refused: more than a trainer can run (run_clock.py).
        self.max_step_jump = max_step_jump
        self.max_steps_per_s = max_steps_per_s
        self.wall_clock = wall_clock
        self.signing_key = signing_key
        # A trainer publishes every step; its queue drops at most ~10k when the bus is away.
        self.max_step_gap = max_step_gap
        self.max_epoch_gap = max_epoch_gap  # one epoch per rollback
        # run_id -> rank -> (epoch, step) of the newest admitted step, and its time.
        self._newest: dict[str, dict[int, tuple[int, int]]] = {}
        self._newest_time: dict[str, dict[int, float]] = {}
        # run_id -> (epoch, step) of the newest step judged, and of the last step of a
        # run whose end was read before that step was judged.
        self._judged: dict[str, tuple[int, int]] = {}
        self._ending: dict[str, tuple[int, int]] = {}
        self.sessions = SessionTable()  # the trainer session each run is in (run_sessions.py)

    def admit(self, topic: str, event: StepEvent) -> None:
        """Raise a StepRejected subclass naming why ``event`` must not be judged."""
        # A step steers the pipeline, an end drops the run's state: only the run's own.
        authenticate(event, self.signing_key)
        # Another session's genuine record (replayed) is refused; a newer one starts the run again.
        if self.sessions.admit(event.run_id, event.session, partial(describe, event)):
            self._newest.pop(event.run_id, None)
            self._newest_time.pop(event.run_id, None)
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
        # A step's time moves the run on no further than the worker's own clock (plus skew).
        at = min(event.time, self.wall_clock() + MAX_CLOCK_AHEAD_S)
        times = self._newest_time.setdefault(event.run_id, {})
        if last is not None:
            since = max(0.0, at - times.get(event.rank, at))
            allowed = min(self.max_step_gap, self.max_step_jump + self.max_steps_per_s * since)
            if event.epoch == last[0] and event.step - last[1] > allowed:
                raise StepOutOfOrder(
                    f"run {event.run_id} rank {event.rank}: step {event.step} of epoch {event.epoch} "
                    f"is {event.step - last[1]} steps past step {last[1]}, the newest judged, "
                    f"{since:.1f} s before it; more than a trainer runs ({allowed:.0f}: "
                    "max_step_jump + max_steps_per_s per second): forged or corrupt; refused, the "
                    "run's state is unchanged"
                )
            if event.epoch - last[0] > self.max_epoch_gap:
                raise StepOutOfOrder(
                    f"run {event.run_id} rank {event.rank}: epoch {event.epoch} is more than "
                    f"{self.max_epoch_gap} epochs past epoch {last[0]}, the newest judged "
                    "(more rollbacks than a trainer makes between two steps: forged or corrupt); "
                    "refused, the run's state is unchanged"
                )
        ranks[event.rank] = here
        times[event.rank] = at

    def restore(self, state: dict) -> None:
        # A restored run is judged again from its snapshot's offsets: those replays are not
        # out of order, so its newest admitted step starts over.
        super().restore(state)
        for run_id in state:
            self._newest.pop(run_id, None)
            self._newest_time.pop(run_id, None)

    def forget(self, run_ids) -> None:  # type: ignore[no-untyped-def]
        run_ids = list(run_ids)
        super().forget(run_ids)
        for run_id in run_ids:
            self._newest.pop(run_id, None)
            self._newest_time.pop(run_id, None)
            self._judged.pop(run_id, None)
            self._ending.pop(run_id, None)
        self.sessions.forget(run_ids)

    def shrink(self) -> None:
        super().shrink()
        self._newest_time = dict(self._newest_time)
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

    def _restart(self, run_id: str) -> None:
        """A newer session of the run: its detector starts afresh (nothing of the old one judges it)."""
        self.runs.pop(run_id, None)
        self._judged.pop(run_id, None)
        self._ending.pop(run_id, None)

    def _judge(self, events: list[StepEvent]) -> list[Output]:
        first, last = events[0], events[-1]
        if (
            one_run(events)
            and first.session == last.session
            and (last.session is None or last.session == self.sessions.handled.get(last.run_id))
        ):
            return self._judge_now(events)  # the usual batch: one run, in the session it is in
        return self._judge_by_session(events)

    def _judge_now(self, events: list[StepEvent]) -> list[Output]:
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

    def _judge_by_session(self, events: list[StepEvent]) -> list[Output]:
        """``events`` in runs of one session each, a run's detector started afresh at a newer one."""
        out: list[Output] = []
        chunk: list[StepEvent] = []
        for event in events:
            entered = self.sessions.enter(event.run_id, event.session)
            if entered and chunk:
                out += self._judge_now(chunk)
                chunk = []
            if entered:
                self._restart(event.run_id)
            chunk.append(event)
        return out + self._judge_now(chunk) if chunk else out

    def _on_run_event(self, event: RunEvent) -> None:
        if self.sessions.enter(event.run_id, event.session):
            self._restart(event.run_id)
        if event.kind != "end":
            return
        last = (event.epoch, event.step - 1)
        if event.run_id in self.runs and self._judged.get(event.run_id, (-1, -1)) < last:
            self._ending[event.run_id] = last  # its last steps are still on their way
        else:
            self.end_runs([event.run_id])


def with_values(verdicts: list[Verdict], events: Sequence[StepEvent]) -> list[Verdict]:
    """Each verdict with its step's loss, gradient norm and session: fusion's evidence comes from
    them, and the session goes on to the decision and its actions."""
    return [
        v
        if v.loss is not None and v.session == e.session
        else v.model_copy(
            update={
                "loss": e.loss if v.loss is None else v.loss,
                "grad_norm": e.grad_norm if v.loss is None else v.grad_norm,
                "session": e.session,
            }
        )
        for v, e in zip(verdicts, events)
    ]
