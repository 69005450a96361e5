"""The fusion stage: verdicts (and run starts/ends) in, one fusion per run, decisions out.

Verdicts come on two topics: one :class:`Verdict` per record from independent
detector workers (``verdicts``), and one :class:`StepVerdicts` per step from a
co-hosted detector worker (``step-verdicts``): a step's verdicts decoded and
authenticated once. Both are the same verdicts to a run's fusion, in arrival order.

A run's RunEvent (the ``runs`` topic) may carry FusionConfig overrides (its
``fusion`` field); they apply to that run over this stage's own settings,
from when the start arrives (see :mod:`.run_settings` for order, bad
settings and ends). With a signing key, only the run events the run's Guard
signed are applied; the rest go to the DLQ (``RunSettingsStage.admit``), as
do verdicts the detector workers did not sign.

**An outage never changes a decision.** Fusion stops waiting for a detector
whose watermark has not moved for ``deadline_seconds``; measured on the wall
clock, a broker outage (or a restart of fusion) longer than that made every
silent detector look dead, and the steps pending across it were decided
without them (a spike decided ``loss_spike`` instead of the rules' critical
``extreme_loss``: no rollback). So the time fusion gives a detector runs on a
*flow clock*: wall time, minus every stretch of more than
:data:`QUIET_GAP_S` in which no verdict at all arrived. While verdicts flow,
a stalled detector is given up on as before; while nothing flows (the broker
is away, the detectors all lag, fusion was down) nobody is given up on, and a
restored run's watermarks count from when fusion came back.

When verdicts flow again after such a stretch (or fusion restores a run), the
detectors rejoin at their own pace: one that lags the others by more than
``deadline_seconds`` would still be given up on while the others' verdicts
move the flow clock. So the end of a quiet stretch and a restore are an
outage's end to every run's fusion (:meth:`Fusion.resume`): a detector alive
when it began is waited for up to ``recovery_seconds`` after it.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any, Callable, Iterable, Sequence

from pydantic import BaseModel, SecretStr

from spikeguard.processors.detector_stage import one_run
from spikeguard.processors.fusion import UNDO_POINT, Fusion
from spikeguard.processors.fusion_config import FusionConfig
from spikeguard.streaming.run_settings_stage import RunSettingsStage, handled_through, over
from spikeguard.schemas import RunEvent, StepVerdicts, Topics, Verdict
from spikeguard.streaming.run_clock import RunClock
from spikeguard.streaming.stage import Output

_TOPIC = itemgetter(0)
_EVENT = itemgetter(1)
# What a fusion drops on purpose, counted per run; the stage exports the increments.
_IGNORED = attrgetter("late_verdicts", "stale_verdicts", "duplicate_verdicts")
_REASONS = ("late_verdict", "stale_verdict", "duplicate_verdict")
#: A stretch without any verdict longer than this does not count towards fusion's deadlines.
QUIET_GAP_S = 1.0


def unpacked(events: Iterable[BaseModel]) -> list[Verdict]:
    """The verdicts of ``events``, each StepVerdicts record's in its place."""
    out: list[Verdict] = []
    for event in events:
        if type(event) is StepVerdicts:
            out += event.verdicts  # type: ignore[attr-defined]
        else:
            out.append(event)  # type: ignore[arg-type]
    return out


class FusionStage(RunSettingsStage):
    """verdicts -> one decision per step, deadlines checked on every tick.

    ``factory(run_id)`` builds a run's fusion with the stage's settings,
    ``factory(run_id, config)`` with a run's own; ``defaults`` are the settings
    a run's overrides apply over.
    """

    name = "fusion"
    sets_clock = (Verdict, StepVerdicts)

    def __init__(
        self,
        topics: Topics,
        factory: Callable[..., Fusion],
        defaults: FusionConfig | None = None,
        end_grace_seconds: float = 30.0,
        signing_key: SecretStr | None = None,
        clock: RunClock | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(topics, factory, end_grace_seconds, signing_key, clock)
        self.wall_clock = wall_clock  # when a batch arrives (the worker's own clock drives tick)
        self.defaults = defaults or FusionConfig()
        self._ignored: Counter[str] = Counter()
        # The flow clock (module doc): wall time minus the quiet stretches so far.
        self._last_input: float | None = None  # wall time of the newest batch (None: none yet)
        self._quiet_total = 0.0

    def inputs(self) -> dict[str, type[BaseModel]]:
        return {
            self.topics.verdicts: Verdict,
            self.topics.step_verdicts: StepVerdicts,
            self.topics.runs: RunEvent,
        }

    # -- the run's own settings (run_settings.RunSettingsStage) -----------------
    def given(self, event: RunEvent) -> dict[str, Any]:
        return {"fusion": dict(event.fusion)} if event.fusion else {}

    def settings_of(self, run_id: str, given: dict[str, Any]) -> FusionConfig:
        return over(self.defaults, given.get("fusion", {}), "fusion overrides", run_id)

    def handled(self, run_id: str, end_epoch: int, end_step: int) -> bool:
        epoch, step = self.runs[run_id].progress
        return handled_through(epoch, step, end_epoch, end_step)

    # -- the flow clock ----------------------------------------------------------
    def flow_time(self, now: float, arrived: bool = False) -> float:
        """Wall time ``now`` on the flow clock; ``arrived``: verdicts came in at ``now``
        (after a quiet stretch, that ends an outage for every run's fusion)."""
        last = self._last_input
        quiet = (
            0.0 if last is None else max(0.0, now - last - QUIET_GAP_S)
        )  # the current stretch, beyond the gap
        flow = now - self._quiet_total - quiet
        if arrived:
            self._quiet_total += quiet
            self._last_input = now
            if quiet:
                for fusion in self.runs.values():
                    fusion.resume(flow, now - last)  # type: ignore[operator]
        return flow

    def restore(self, state: dict[str, Any]) -> None:
        # A restored run's watermarks were last moved before fusion stopped: the time it was
        # down is a quiet stretch too, so they count from now (Fusion.state_dict's "marks":
        # detector -> [step, time], and "epoch_seen_at").
        flow = self.flow_time(self.wall_clock())
        # A batch rewound to its undo point (Worker) is put back as it was: no time passed.
        restarted = [
            run_id
            for run_id, run_state in state.items()
            if isinstance(run_state, dict) and not run_state.get(UNDO_POINT)
        ]
        for run_state in map(state.__getitem__, restarted):
            if run_state.get("marks"):
                run_state["marks"] = {
                    name: [mark[0], flow] for name, mark in run_state["marks"].items()
                }
            if run_state.get("epoch_seen_at") is not None:
                run_state["epoch_seen_at"] = flow
        super().restore(state)
        for run_id in restarted:  # a restart is an outage: its detectors are recovering
            if run_id in self.runs:
                self.runs[run_id].resume(flow, math.inf)

    # -- processing ----------------------------------------------------------------
    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        wall = self.wall_clock()
        now = self.flow_time(wall, arrived=True)  # what the fusions' deadlines see
        runs = self.topics.runs
        if runs not in map(_TOPIC, items):
            decisions = self._verdicts(unpacked(map(_EVENT, items)), now)
        else:  # run starts and ends in their place among the verdicts
            decisions, chunk = [], []
            for topic, event in items:
                if topic != runs:
                    chunk.append(event)
                    continue
                if chunk:
                    decisions += self._verdicts(unpacked(chunk), now)
                    chunk = []
                self.run_event(event, wall)  # type: ignore[arg-type]
            if chunk:
                decisions += self._verdicts(unpacked(chunk), now)
        topic = self.topics.decisions
        return list(zip(repeat(topic), decisions)) + self._end_due(wall)

    def _verdicts(self, verdicts: list, now: float) -> list:
        first, last = verdicts[0], verdicts[-1]
        if (  # the usual batch: one run, in the session it is in: one call for all of it
            one_run(verdicts)
            and first.session == last.session
            and (last.session is None or self.sessions.handled.get(last.run_id) == last.session)
        ):
            fusion = self.run(verdicts[0].run_id)
            before = _IGNORED(fusion)
            decisions = fusion.add_many(verdicts, now)
            self._tally(before, _IGNORED(fusion))
            return decisions
        decisions = []  # in arrival order across runs, as decisions must leave
        touched: dict[str, tuple] = {}
        for verdict in verdicts:
            if verdict.session is not None and verdict.session != self.sessions.handled.get(
                verdict.run_id
            ):
                # A newer session starts the run's fusion afresh: count the old one's drops first.
                if verdict.run_id in touched:
                    old, before = touched.pop(verdict.run_id)
                    self._tally(before, _IGNORED(old))
                self.enter_session(verdict.run_id, verdict.session)
            fusion = self.run(verdict.run_id)
            if verdict.run_id not in touched:
                touched[verdict.run_id] = (fusion, _IGNORED(fusion))
            decisions += fusion.add(verdict, now)
        for fusion, before in touched.values():
            self._tally(before, _IGNORED(fusion))
        return decisions

    def _end_due(self, now: float) -> list[Output]:
        """End the runs whose last step is decided (or whose grace ran out); pending steps go out first."""
        ended = self.due_ends(now)
        if not ended:
            return []
        topic = self.topics.decisions
        out = [
            (topic, d) for run_id in ended if run_id in self.runs for d in self.runs[run_id].flush()
        ]
        self.end_runs(ended)
        return out

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
        flow = self.flow_time(now)
        out = [(topic, d) for fusion in self.runs.values() for d in fusion.tick(flow)]
        return out + self._end_due(now)

    def flush(self) -> list[Output]:
        topic = self.topics.decisions
        return [(topic, d) for fusion in self.runs.values() for d in fusion.flush()]

    def flush_runs(self, run_ids: Iterable[str]) -> list[Output]:
        """An idle run is evicted: its pending steps are decided first, not dropped."""
        topic = self.topics.decisions
        return [
            (topic, d)
            for run_id in run_ids
            if run_id in self.runs
            for d in self.runs[run_id].flush()
        ]
