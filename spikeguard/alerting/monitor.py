"""The monitor: a stage reading steps, decisions, actions, acks and checkpoints.

It measures what no single pipeline stage can, because it needs two topics:
decision latency (a step's wall-clock time to its decision arriving here) and
action round trip (a decision arriving here to the trainer's ack of the action
it caused), both on this process's clock except the step's own time. It
announces incidents through a :class:`Notifier`, and removes a run's metrics
when the run ends (its ``final`` checkpoint).

It publishes nothing; the only state worth keeping across a restart is which
incidents were already announced.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

from pydantic import BaseModel

from spikeguard.alerting.notifier import Notifier
from spikeguard.metrics import Metrics
from spikeguard.schemas import Ack, Action, CheckpointEvent, Decision, StepEvent, Topics
from spikeguard.streaming.stage import Output, Stage

_PENDING = 4096  # per run: steps awaiting their decision, decisions awaiting an ack


def _bounded_put(store: OrderedDict, key: Any, value: Any, limit: int = _PENDING) -> None:
    store[key] = value
    while len(store) > limit:
        store.popitem(last=False)


class _RunWatch:
    __slots__ = ("step_times", "early", "decided", "actions")

    def __init__(self) -> None:
        self.step_times: OrderedDict[tuple[int, int], float] = OrderedDict()  # (epoch, step)
        # Decisions read before their step (topics are read in no fixed order): when seen.
        self.early: OrderedDict[tuple[int, int], float] = OrderedDict()
        self.decided: OrderedDict[str, float] = OrderedDict()  # decision_id -> seen
        self.actions: OrderedDict[str, str] = OrderedDict()  # action_id -> decision_id


class MonitorStage(Stage):
    name = "monitor"

    def __init__(
        self,
        topics: Topics,
        metrics: Metrics,
        notifier: Notifier | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(topics)
        self.metrics = metrics
        self.notifier = notifier
        self.clock = clock
        self.runs: dict[str, _RunWatch] = {}

    def inputs(self) -> dict[str, type[BaseModel]]:
        t = self.topics
        return {
            t.steps: StepEvent,
            t.decisions: Decision,
            t.actions: Action,
            t.acks: Ack,
            t.checkpoints: CheckpointEvent,
        }

    def _run(self, run_id: str) -> _RunWatch:
        watch = self.runs.get(run_id)
        if watch is None:
            watch = self.runs[run_id] = _RunWatch()
        return watch

    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        now = self.clock()
        m = self.metrics
        for _, event in items:
            if isinstance(event, StepEvent):
                watch = self._run(event.run_id)
                key = (event.epoch, event.step)
                decided = watch.early.pop(key, None)
                if decided is not None:
                    m.decision_latency.observe(max(0.0, decided - event.time))
                else:
                    _bounded_put(watch.step_times, key, event.time)
            elif isinstance(event, Decision):
                watch = self._run(event.run_id)
                key = (event.epoch, event.step)
                stepped = watch.step_times.pop(key, None)
                if stepped is not None:
                    m.decision_latency.observe(max(0.0, now - stepped))
                else:
                    _bounded_put(watch.early, key, now)
                if event.is_anomaly or event.preventive:
                    _bounded_put(watch.decided, event.decision_id, now)
                if self.notifier is not None:
                    self.notifier.offer(event, now)
            elif isinstance(event, Action):
                if event.decision_id:
                    _bounded_put(
                        self._run(event.run_id).actions, event.action_id, event.decision_id
                    )
            elif isinstance(event, Ack):
                watch = self._run(event.run_id)
                decision_id = watch.actions.pop(event.action_id, None)
                decided = watch.decided.get(decision_id) if decision_id else None
                if decided is not None:
                    m.action_round_trip.labels(event.kind.value).observe(max(0.0, now - decided))
            elif isinstance(event, CheckpointEvent) and event.reason == "final":
                self._ended(event.run_id)
        return []

    def _ended(self, run_id: str) -> None:
        """The trainer closed the run: its series go, so cardinality stays bounded."""
        self.runs.pop(run_id, None)
        self.metrics.forget_run(run_id)

    # -- state ----------------------------------------------------------------
    def snapshot(self, run_ids: Iterable[str]) -> dict[str, Any]:
        if self.notifier is None:
            return {}
        return {
            run_id: {"announced": [i for i, r in self.notifier.announced.items() if r == run_id]}
            for run_id in set(run_ids)
        }

    def restore(self, state: dict[str, Any]) -> None:
        if self.notifier is None:
            return
        for run_id, run_state in state.items():
            self.notifier.load_state_dict(
                {"announced": [[i, run_id] for i in run_state.get("announced", [])]}
            )

    def forget(self, run_ids: Iterable[str]) -> None:
        run_ids = list(run_ids)
        for run_id in run_ids:
            self.runs.pop(run_id, None)
        if self.notifier is not None:
            self.notifier.forget(run_ids)
