"""A run's own settings, as its RunEvent on the compacted ``runs`` topic gives them.

The trainer's Guard publishes a RunEvent when the run starts and when it ends,
both with the run's preset, policy overrides and checkpoint cadence. Fusion and
the actuator read that topic next to their usual inputs and apply, per run,
the run's settings over their own defaults. Three things make this less simple
than it reads:

- **Order.** The runs topic is not the verdicts or decisions topic, so a run's
  start may be consumed after its first verdicts or decisions. Those are
  handled with the stage's defaults; when the start arrives the run's object is
  rebuilt with the run's settings and its state carried over (nothing judged
  so far is judged again). A rerun from the start (a replay) sees the same
  records in the same per-topic order, and so the same decisions, only when
  the start came first: the Guard publishes it before its first step, so that
  is the usual case.
- **Bad settings.** A start whose settings do not validate is refused
  (:class:`~spikeguard.errors.RunSettingsRejected`: the worker sends it to the
  DLQ with the reason) and the run keeps the stage's defaults; the stage
  never dies on it.
- **Trust.** These records steer a run (a start's settings, an end that drops
  its state), so with a signing key a stage admits only those the run's Guard
  signed (:func:`~spikeguard.schemas.signing.authenticate`): anything else goes to the DLQ as
  :class:`~spikeguard.errors.RunEventNotAuthenticated` and changes nothing.
  Without a key (``--insecure``, backtests, replays) every run event is taken.
- **Sessions.** Every record a trainer publishes names its session (a nonce
  its Guard drew at start): a record of an older session than the run's, a
  genuine one replayed, is refused as
  :class:`~spikeguard.errors.RecordOfOtherSession`; the first record of a
  newer one (the run started again) starts the run's object afresh
  (:meth:`RunSettingsStage.enter_session`), whatever the old session left
  (:mod:`spikeguard.streaming.run_sessions`).
- **Ends.** A run's end may also overtake its last verdicts or decisions. The
  stage therefore ends a run (``Stage.end_runs``: its state is dropped) only
  once it has handled the run's last step, or after ``grace_seconds`` of wall
  clock, whichever comes first; a start of the same run id (a resume) cancels
  a pending end.

The run's given settings and a pending end are part of the run's snapshot,
so a restarted worker keeps them without re-reading the runs topic.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from functools import partial
from typing import Any, Callable, Iterable

from pydantic import BaseModel, SecretStr, ValidationError

from spikeguard.errors import RunSettingsRejected
from spikeguard.schemas import RunEvent
from spikeguard.schemas.signing import authenticate, describe
from spikeguard.streaming.run_clock import RunClock
from spikeguard.streaming.run_sessions import SessionTable, session_of
from spikeguard.streaming.stage import PerRunStage

# Keys of the run's entry in a stage snapshot, next to the object's own state.
SETTINGS_KEY = "run_settings"
END_KEY = "run_end"
CLOCK_KEY = "run_clock"
SESSION_KEY = "run_session"


def validated(model: type[BaseModel], values: dict[str, Any], what: str, run_id: str) -> Any:
    """``model(**values)``, or RunSettingsRejected naming the run, what was refused and why."""
    try:
        return model.model_validate(values)
    except (ValidationError, TypeError, ValueError) as exc:
        detail = (
            "; ".join(
                f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}"
                for e in exc.errors(include_url=False)
            )
            if isinstance(exc, ValidationError)
            else str(exc)
        )
        raise RunSettingsRejected(
            f"run {run_id}: {what} do not validate ({detail}); the run keeps this stage's defaults"
        ) from None


def over(defaults: BaseModel, overrides: dict[str, Any], what: str, run_id: str) -> Any:
    """``defaults`` with ``overrides`` on top, validated as the same model."""
    if not overrides:
        return defaults
    return validated(type(defaults), {**defaults.model_dump(), **overrides}, what, run_id)


class EndingRuns:
    """Runs whose end arrived, waiting until their last step was handled (or the grace ran out)."""

    def __init__(self, grace_seconds: float = 30.0) -> None:
        self.grace_seconds = grace_seconds
        self.pending: dict[str, tuple[int, int, float]] = {}  # run_id -> (epoch, end step, since)

    def end(self, event: RunEvent, now: float) -> None:
        self.pending[event.run_id] = (event.epoch, event.step, now)

    def restore(self, run_id: str, mark: list[int], now: float) -> None:
        self.pending[run_id] = (int(mark[0]), int(mark[1]), now)

    def mark(self, run_id: str) -> list[int] | None:
        found = self.pending.get(run_id)
        return None if found is None else [found[0], found[1]]

    def cancel(self, run_id: str) -> None:
        self.pending.pop(run_id, None)

    def due(self, now: float, handled: Callable[[str, int, int], bool]) -> list[str]:
        """Remove and return the runs to end now: ``handled(run_id, epoch, end_step)``, or too old."""
        if not self.pending:
            return []
        out = [
            run_id
            for run_id, (epoch, step, since) in self.pending.items()
            if now - since >= self.grace_seconds or handled(run_id, epoch, step)
        ]
        for run_id in out:
            del self.pending[run_id]
        return out


def handled_through(epoch: int, step: int, end_epoch: int, end_step: int) -> bool:
    """True when ``(epoch, step)`` (the newest handled) has reached a run's end: its last step is ``end_step - 1``."""
    return epoch > end_epoch or (epoch == end_epoch and step >= end_step - 1)


class RunSettingsStage(PerRunStage):
    """A per-run stage that also reads the runs topic: each run under its own settings.

    Every record it reads is checked against the run's clock; only a run's start
    and the records of :attr:`sets_clock` (the stage's main input) move it, so a
    side input (a checkpoint, an ack) read before them cannot set where the run is.

    ``factory(run_id)`` builds a run's object with the stage's settings,
    ``factory(run_id, config)`` with the run's own. Subclasses say which fields
    of a RunEvent they use (:meth:`given`), what config those make
    (:meth:`settings_of`, raising RunSettingsRejected) and when a run's last
    step is handled (:meth:`handled`).
    """

    #: The records that move a run's clock (besides its start); the others are only checked.
    sets_clock: tuple[type[BaseModel], ...] = ()

    def __init__(
        self,
        topics: Any,
        factory: Callable[..., Any],
        end_grace_seconds: float = 30.0,
        signing_key: SecretStr | None = None,
        clock: RunClock | None = None,
    ) -> None:
        super().__init__(topics, factory)
        # With a key, only records signed by their producer are taken (run events: the run's Guard).
        self.signing_key = signing_key
        self.clock = clock or RunClock()  # how far each run has got: nothing far beyond is adopted
        self._given: dict[str, dict[str, Any]] = {}  # run_id -> the RunEvent fields this stage uses
        self.ending = EndingRuns(end_grace_seconds)
        self.sessions = SessionTable()  # the trainer session each run is in

    @abstractmethod
    def given(self, event: RunEvent) -> dict[str, Any]:
        """The fields of ``event`` this stage applies (empty: the run uses the stage's settings)."""

    @abstractmethod
    def settings_of(self, run_id: str, given: dict[str, Any]) -> Any:
        """The run's config from :meth:`given`'s output; RunSettingsRejected with the reason."""

    @abstractmethod
    def handled(self, run_id: str, end_epoch: int, end_step: int) -> bool:
        """True when the run's object has handled its last step (``end_step - 1`` of ``end_epoch``)."""

    def admit(self, topic: str, event: BaseModel) -> None:
        """Refuse (to the DLQ, with the reason) a record not signed with the key, one far beyond
        the run's clock, and a start whose settings do not validate."""
        authenticate(event, self.signing_key)
        run_id, step = event.run_id, event.step  # type: ignore[attr-defined]
        what = partial(describe, event)  # the words only for a refusal
        if self.sessions.admit(run_id, session_of(event), what):
            self.clock.forget([run_id])  # the run started again: its clock starts from here
        # An ack has no epoch: its step alone is checked against the run's furthest.
        epoch = getattr(event, "epoch", None)
        self.clock.check(run_id, epoch, step, what)
        if epoch is not None and (  # (every record that moves the clock has an epoch)
            isinstance(event, self.sets_clock)
            or isinstance(event, RunEvent)
            and event.kind == "start"
        ):
            self.clock.advance(run_id, epoch, step)
        if isinstance(event, RunEvent) and event.kind == "start":  # a subclass too
            given = self.given(event)
            if given:
                self.settings_of(event.run_id, given)

    def enter_session(self, run_id: str, session: str | None) -> None:
        """A record of ``session`` is handled now: a newer session than the run's object was
        built in starts it afresh (a pending end of the old session is called off)."""
        if self.sessions.enter(run_id, session):
            self.runs.pop(run_id, None)
            self.ending.cancel(run_id)

    def run_event(self, event: RunEvent, now: float) -> None:
        """A start applies the run's settings; an end waits for the run's last step (see :meth:`due_ends`)."""
        self.enter_session(event.run_id, event.session)
        if event.kind == "end":
            self.ending.end(event, now)
            return
        self.ending.cancel(event.run_id)  # the same run id started again (a resume)
        self.configure(event.run_id, self.given(event))

    def configure(self, run_id: str, given: dict[str, Any]) -> Any:
        """The run's object under its own settings, its state so far carried over."""
        config = self.settings_of(run_id, given) if given else None
        if given:
            self._given[run_id] = given
        else:
            self._given.pop(run_id, None)
        old = self.runs.get(run_id)
        if old is not None and (config is None or old.config == config):
            return old
        make: Callable[..., Any] = self.factory  # (run_id) or (run_id, config)
        new = self.runs[run_id] = make(run_id) if config is None else make(run_id, config)
        if old is not None:
            new.load_state_dict(old.state_dict())
        return new

    def due_ends(self, now: float) -> list[str]:
        """The runs to end now (the caller emits what they still hold, then calls end_runs)."""
        return self.ending.due(
            now,
            lambda run_id, epoch, step: (
                run_id not in self.runs or self.handled(run_id, epoch, step)
            ),
        )

    # -- state: the run's given settings and a pending end travel with its object ----
    def snapshot(self, run_ids: Iterable[str]) -> dict[str, Any]:
        return self._with_settings(super().snapshot(run_ids))

    def undo_point(self, run_ids: Iterable[str]) -> dict[str, Any]:
        # A batch may start or end a run: undoing it puts its settings and end back too.
        return self._with_settings(super().undo_point(run_ids))

    def _with_settings(self, out: dict[str, Any]) -> dict[str, Any]:
        for run_id, state in out.items():
            if run_id in self._given:
                state[SETTINGS_KEY] = self._given[run_id]
            if (mark := self.ending.mark(run_id)) is not None:
                state[END_KEY] = mark
            if (clock := self.clock.state(run_id)) is not None:
                state[CLOCK_KEY] = clock
            if (session := self.sessions.state(run_id)) is not None:
                state[SESSION_KEY] = session
        return out

    def restore(self, state: dict[str, Any]) -> None:
        now = time.time()
        for run_id, run_state in state.items():
            run_state = dict(run_state)
            given = run_state.pop(SETTINGS_KEY, None)
            mark = run_state.pop(END_KEY, None)
            self.clock.restore(run_id, run_state.pop(CLOCK_KEY, None))
            self.sessions.restore(run_id, run_state.pop(SESSION_KEY, None))
            self.runs.pop(run_id, None)
            self.configure(run_id, dict(given or {}))
            self.run(run_id).load_state_dict(run_state)
            if mark is not None:
                self.ending.restore(run_id, mark, now)
            else:
                self.ending.cancel(run_id)

    def forget(self, run_ids: Iterable[str]) -> None:
        run_ids = list(run_ids)
        super().forget(run_ids)
        self.clock.forget(run_ids)
        self.sessions.forget(run_ids)
        for run_id in run_ids:
            self._given.pop(run_id, None)
            self.ending.cancel(run_id)
