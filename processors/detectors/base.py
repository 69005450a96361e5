"""What every detector is: score a step, then learn from it (river's ``score_one`` / ``learn_one``).

A detector defines four pure pieces and a state codec:

* ``fresh()`` — a new run's state: a small value of the detector's own.
* ``score(event, state) -> Verdict`` — judges the step against what came
  before. It changes nothing, so judging the same step twice gives the same
  verdict.
* ``track(event, state, verdict)`` — what moves on at every step, normal or
  not: clocks, the episode a step belongs to (a spike lasts until it has come
  down), the inputs of rolling features. Defaults to nothing.
* ``learn(event, state)`` — what a *normal* step teaches: the baselines.
* ``dump(state)`` / ``load(data)`` — the state as JSON types and back.
* ``pack(state)`` / ``unpack(packed)`` — the state as the rollback history keeps
  it: by default the pickled ``dump`` (a few kB, against tens of kB as live
  objects); a detector with large parts it never changes in place shares them.

Everything around them is done here, once, for every detector:

* **A step judged anomalous is not learnt** (river's ``protect_anomaly_detector``
  / ``QuantileFilter`` idea): a spike cannot teach the baseline that spikes are
  normal. ``protects(verdict)`` is where a detector whose baselines are gated
  more finely says so.
* **Rollbacks.** A step of a newer epoch means the trainer rolled back and
  re-runs from a checkpoint: the run's state is put back as it was before the
  first re-run step (from :class:`StateHistory`), so re-run steps are judged
  as they were the first time. A step of an older epoch is a late duplicate
  from before the rollback: it gets a "stale" verdict and teaches nothing.
* **Versioned state.** ``state_dict()`` is ``dump(state)`` plus the layout
  ``version`` and the ``epoch``; loading another version is
  a :class:`StateVersionError`, not a silently misread state.

One instance judges one run (the worker keeps one per ``run_id``). No I/O:
the same object runs in a worker, a backtest and a unit test. State is
bounded (independent of run length).
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Generic, Sequence, TypeVar

from spikeguard.errors import SpikeguardError
from spikeguard.processors.detectors.history import StateHistory
from spikeguard.schemas import StepEvent, Verdict

S = TypeVar("S")
T = TypeVar("T")

# Verdict(**fields) minus BaseModel.__init__'s Python frame: the same
# validation (a documented pydantic attribute), for the plain verdicts of every step.
validate_verdict = Verdict.__pydantic_validator__.validate_python


class StateVersionError(SpikeguardError, ValueError):
    """A saved detector state of another layout version than this code reads."""


class Detector(ABC, Generic[S]):
    #: The verdict's ``detector`` field and the worker's name.
    name: ClassVar[str]
    #: Layout of ``dump``'s output; bump it when its keys or their meaning change.
    state_version: ClassVar[int] = 1

    def __init__(self, *, snapshot_every: int = 50, max_snapshots: int = 16) -> None:
        # 50: the trainer's default checkpoint cadence, so a rollback target usually has
        # a snapshot of its own (producers.config.GuardConfig.checkpoint_every).
        self.history: StateHistory[Any] = StateHistory(snapshot_every, max_snapshots)
        self.state: S = self.fresh()
        self.epoch = 0  # the newest epoch seen
        self._last_step = -1  # the last step judged in it (-1: none, or not known since a load)
        self._memo: tuple[StepEvent, S, Any] | None = None  # see scored()

    # -- what each detector defines ----------------------------------------------
    @abstractmethod
    def fresh(self) -> S:
        """The state of a run not seen yet."""

    @abstractmethod
    def score(self, event: StepEvent, state: S) -> Verdict:
        """Judge ``event`` against ``state``, changing nothing."""

    def track(self, event: StepEvent, state: S, verdict: Verdict) -> None:
        """Advance what every step moves on, whatever its verdict."""

    @abstractmethod
    def learn(self, event: StepEvent, state: S) -> None:
        """Learn from ``event``, which was judged normal."""

    def protects(self, verdict: Verdict) -> bool:
        """True when a step with this verdict must not be learnt: by default, an anomaly.

        A detector whose baselines have a gate of their own narrows it here,
        saying why (the ML forest's training rows, the statistical detector's
        two separate series).
        """
        return verdict.is_anomaly

    @abstractmethod
    def dump(self, state: S) -> dict[str, Any]:
        """``state`` as JSON types (floats may be NaN/inf)."""

    @abstractmethod
    def load(self, data: dict[str, Any]) -> S:
        """A state from what :meth:`dump` returned."""

    def copy(self, state: S) -> S:
        """An independent copy of ``state`` (for the rollback history)."""
        return self.load(self.dump(state))

    def pack(self, state: S) -> Any:
        """``state`` as the rollback history keeps it: compact, and unchanged by later steps.

        Pickle, not JSON: it keeps NaN, infinities and every float exactly, and is
        faster; the bytes never leave this process (the history is not saved).
        """
        return pickle.dumps(self.dump(state), protocol=pickle.HIGHEST_PROTOCOL)

    def unpack(self, packed: Any) -> S:
        """A new state from what :meth:`pack` returned (the packed value stays as it was)."""
        return self.load(pickle.loads(packed))

    def stale(self, event: StepEvent) -> Verdict:
        """The verdict on a late step from before a rollback: no news, nothing learnt."""
        return validate_verdict(
            {
                "run_id": event.run_id,
                "step": event.step,
                "epoch": event.epoch,
                "detector": self.name,
                "is_anomaly": False,
                "signals": {"stale": 1},
            }
        )

    def scored(self, event: StepEvent, state: S, work: Callable[[StepEvent, S], T]) -> T:
        """``work(event, state)``, computed once per step for ``score`` and ``track`` both.

        What a detector scores with (its features after the step, say) is also what
        ``track`` adopts: worth keeping for the ``track`` right after. Valid only
        until the state changes, so :meth:`update` forgets it at every step.
        """
        memo = self._memo
        if memo is not None and memo[0] is event and memo[1] is state:
            return memo[2]
        value = work(event, state)
        self._memo = (event, state, value)
        return value

    # -- judging: the same for every detector -------------------------------------
    def update(self, event: StepEvent) -> Verdict:
        """Judge ``event``, then learn from it unless it was judged anomalous."""
        if event.epoch != self.epoch:
            if event.epoch < self.epoch:
                return self.stale(event)
            self._roll_back(event)
        history = self.history
        if history.due(event.step):
            history.save(event.step, self.pack(self.state))
        state = self.state
        verdict = self.score(event, state)
        self.track(event, state, verdict)
        self._memo = None  # track may have changed the state it was computed from
        if not self.protects(verdict):
            self.learn(event, state)
        self._last_step = event.step
        return verdict

    def update_many(self, events: Sequence[StepEvent]) -> list[Verdict]:
        """Judge a batch of one run's consecutive events, in order."""
        update = self.update
        return [update(event) for event in events]

    def _roll_back(self, event: StepEvent) -> None:
        """A new epoch: the state as it was before the first re-run step."""
        self.epoch = event.epoch
        if 0 <= self._last_step < event.step:
            return  # a new epoch that re-runs nothing: the state is already right
        found = self.history.rewind(event.step, self.unpack)
        # Nothing kept from that far back: start over (warm-up is silent).
        self.state = self.fresh() if found is None else found[1]

    # -- state ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's state as JSON types, with its layout version."""
        return {"version": self.state_version, "epoch": self.epoch, **self.dump(self.state)}

    def undo_state(self) -> dict[str, Any]:
        """The run's state for a worker's per-batch undo (``Stage.undo_point``): never saved.

        Taken before every batch and almost never used. A detector whose ``pack`` is its
        own gives the state as the rollback history packs it, not its JSON: the ML
        detector's pack shares its rows (their JSON was most of a co-hosted detectors
        worker's undo, py-spy); the others give their ``state_dict``.
        :meth:`load_state_dict` takes it back.
        """
        cls = type(self)
        # Only a pack of its own is cheaper than the JSON (the default pack pickles the dump);
        # a layout of its own (state_dict overridden) must come back through its own loader.
        if cls.pack is Detector.pack or cls.state_dict is not Detector.state_dict:
            return self.state_dict()
        return {"version": self.state_version, "epoch": self.epoch, "undo": self.pack(self.state)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt what :meth:`state_dict` (or :meth:`undo_state`) returned.

        The rollback history stays when the epoch is the same: its snapshots are
        states this run went through (a retried batch goes through them again).
        """
        version = state.get("version")
        if version != self.state_version:
            raise StateVersionError(
                f"{self.name} detector state has version {version!r}; "
                f"this code reads version {self.state_version}"
            )
        self.state = self.unpack(state["undo"]) if "undo" in state else self.load(state)
        self._last_step = -1
        if int(state["epoch"]) != self.epoch:
            self.history.clear()  # another timeline's snapshots
        self.epoch = int(state["epoch"])
