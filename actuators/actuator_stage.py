"""The actuator stage: decisions, checkpoints, acks and run starts/ends in; signed actions out.

Each run gets the recovery policy its RunEvent names (preset, overrides:
:mod:`.run_settings`), over the stage's own; until its start arrives it runs
under the stage's own, and when it does the run's policy takes over with the
state so far (see :mod:`spikeguard.streaming.run_settings_stage`). A start whose
checkpoint cadence cannot give the run's policy a rollback target is answered
with one warning ALERT, which the trainer logs. The key that signs the actions
also authenticates the run events: one not signed by the run's Guard goes to
the DLQ and changes nothing (``RunSettingsStage.admit``); so does a decision,
checkpoint event or ack not signed by its producer, or far beyond the run's clock.

Nothing orders the decisions topic against the acks topic: after a restart the actuator
reads a backlog, and a rollback's re-run (its new epoch) can be decided before its ack
arrives. A trainer's epoch moves only by applying a rollback, so a decision of a newer epoch
than the policy's settles its unsettled rollback as applied (``_applied_by_epoch``): no
"not acknowledged" alert for it, and the re-run is judged as it is when the ack comes first.

Every ``pulse_interval_s`` at most (None: never), a run whose decisions arrive gets a signed
``pulse`` action naming the newest step decided: its trainer learns that its
steps are judged, and says so when they are not (producers/protection.py).
A decision the interval held back is pulsed by the stage's tick once the
interval has passed, whether or not another decision comes: a trainer that
pauses (an evaluation, a long save) after a burst of steps would otherwise
wait for a pulse naming them until it trains again, and call itself
unprotected meanwhile.

A run whose start says ``lockstep`` (its trainer waits for each step's judgement, for
reproducible demos and tests) gets a pulse for every decision, published after the actions
that decision caused: its trainer waits for that pulse, so each action lands at the step it
is due whatever the pipeline's speed (producers/lockstep.py).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Callable, Iterable, Sequence

from pydantic import BaseModel, SecretStr

from spikeguard.actuators.action_plan import ActionPlan
from spikeguard.actuators.config import PolicyConfig
from spikeguard.actuators.run_settings import cadence_problem, given_policy, run_policy
from spikeguard.streaming.run_settings_stage import RunSettingsStage, handled_through
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    CheckpointEvent,
    Decision,
    RunEvent,
    Topics,
    action_id,
)
from spikeguard.schemas.signing import sign_action
from spikeguard.streaming.run_clock import RunClock
from spikeguard.streaming.stage import Output


log = logging.getLogger(__name__)
#: Incidents per run whose first actions are logged; a run with more is in worse trouble than a
#: log line can say (its alerts and the report say it).
MAX_INCIDENTS_SAID = 100


class ActuatorStage(RunSettingsStage):
    name = "actuator"
    sets_clock = (Decision,)

    def __init__(
        self,
        topics: Topics,
        factory: Callable[..., Any],
        signing_key: SecretStr | None = None,
        defaults: PolicyConfig | None = None,
        end_grace_seconds: float = 30.0,
        clock: RunClock | None = None,
        pulse_interval_s: float | None = None,
    ) -> None:
        super().__init__(topics, factory, end_grace_seconds, signing_key, clock)
        self.pulse_interval_s = (
            pulse_interval_s  # None: no pulses (backtests, replays: nobody listens)
        )
        self._pulsed: dict[str, float] = {}  # run_id -> wall time of its newest pulse
        self._unpulsed: dict[str, Decision] = {}  # run_id -> its newest decision not pulsed yet
        self._incidents_said: dict[str, set[str]] = {}  # run_id -> incidents logged (bounded)
        self.defaults = defaults or PolicyConfig()
        # Decisions a policy ignores on purpose (policy.counts), exported as increments.
        self._ignored: Counter[str] = Counter()

    def inputs(self) -> dict[str, type[BaseModel]]:
        return {
            self.topics.decisions: Decision,
            self.topics.checkpoints: CheckpointEvent,
            self.topics.acks: Ack,
            self.topics.runs: RunEvent,
        }

    # -- the run's own settings (run_settings_stage.RunSettingsStage) -----------------
    def given(self, event: RunEvent) -> dict[str, Any]:
        return given_policy(event)

    def settings_of(self, run_id: str, given: dict[str, Any]) -> PolicyConfig:
        return run_policy(run_id, given, self.defaults)

    def handled(self, run_id: str, end_epoch: int, end_step: int) -> bool:
        policy = self.runs[run_id]
        return handled_through(policy.epoch, policy.high_water, end_epoch, end_step)

    # -- processing ----------------------------------------------------------------
    def handle_batch(self, items: Sequence[tuple[str, BaseModel]]) -> list[Output]:
        out: list[Output] = []
        now = time.time()
        for _, event in items:
            # A newer session of the run starts its policy afresh; what answers a record is
            # for the trainer session that published it (a trainer refuses another session's).
            session = event.session  # type: ignore[attr-defined]
            self.enter_session(event.run_id, session)  # type: ignore[attr-defined]
            if isinstance(event, RunEvent):
                actions = self._run_event(event, now)
            else:
                policy = self.run(event.run_id)  # type: ignore[attr-defined]
                if isinstance(event, Decision):
                    counts = dict(policy.counts)
                    actions = self._applied_by_epoch(policy, event)
                    actions += policy.on_decision(event)
                    self._say_incident(event.run_id, actions)
                    actions += self._pulse(event, now)
                    if policy.counts != counts:  # duplicate, late, or from an abandoned timeline
                        for reason, n in policy.counts.items():
                            if n > counts.get(reason, 0):
                                self._ignored[f"{reason}_decision"] += n - counts.get(reason, 0)
                elif isinstance(event, CheckpointEvent):
                    actions = policy.on_checkpoint(event)
                else:
                    actions = policy.on_ack(event)
            session = session or self.sessions.state(event.run_id)  # type: ignore[attr-defined]
            if session is not None and actions:
                actions = [a.model_copy(update={"session": session}) for a in actions]
            out += self._signed(actions)
        self._end_due(now)
        return out

    def _run_event(self, event: RunEvent, now: float) -> list[Action]:
        self.run_event(event, now)
        if event.kind != "start":
            return []
        policy = self.run(event.run_id)
        problem = cadence_problem(
            event.checkpoint_every,
            event.keep_checkpoints,
            event.detection_delay_steps,
            policy.config.rollback_min_steps_before_onset,
        )
        if problem is None:
            return []
        # Deterministic id: a redelivered start gives the same alert, which the trainer dedupes.
        plan = ActionPlan(
            event.run_id, f"run-start/{event.epoch}/{event.step}", policy.epoch, event.step
        )
        plan.alert(
            "warning",
            f"the policy this pipeline applies to run {event.run_id} cannot roll it back: "
            f"{problem}",
        )
        return plan.actions()

    @staticmethod
    def _applied_by_epoch(policy: Any, decision: Decision) -> list[Action]:
        """The APPLIED ack of the policy's unsettled rollback, when ``decision`` is of a newer
        epoch than the policy's (the trainer applied it; its own ack may come later)."""
        if decision.epoch <= policy.epoch:
            return []
        unsettled = [r for r in policy.recovery.rollbacks if r.status in ("pending", "timed_out")]
        if not unsettled:
            return []
        rollback = unsettled[-1]
        return list(
            policy.on_ack(
                Ack(
                    run_id=decision.run_id,
                    action_id=rollback.action_id,
                    kind=ActionKind.ROLLBACK,
                    status=AckStatus.APPLIED,
                    step=rollback.apply_at_step,
                    result=f"applied: the run's steps of epoch {decision.epoch} say so",
                )
            )
        )

    def _pulse(self, decision: Decision, now: float) -> list[Action]:
        """A pulse for the decision's run, if its last one is ``pulse_interval_s`` old (else the
        decision waits for :meth:`tick` to pulse it)."""
        if self.pulse_interval_s is None:
            return []
        run_id = decision.run_id
        last = self._pulsed.get(run_id)
        # A lockstep run's start (its given settings, kept in the run's snapshots) asks for all.
        lockstep = self._given.get(run_id, {}).get("lockstep", False)
        if not lockstep and last is not None and now - last < self.pulse_interval_s:
            held = self._unpulsed.get(run_id)
            if held is None or (decision.epoch, decision.step) > (held.epoch, held.step):
                self._unpulsed[run_id] = decision
            return []
        self._pulsed[run_id] = now
        self._unpulsed.pop(run_id, None)
        return [
            Action(
                action_id=action_id(decision.decision_id, ActionKind.PULSE.value),
                run_id=decision.run_id,
                kind=ActionKind.PULSE,
                apply_at_step=decision.step,
                params={"judged_step": decision.step, "epoch": decision.epoch},
                reason="the pipeline judged the run up to this step",
            )
        ]

    def _say_incident(self, run_id: str, actions: list[Action]) -> None:
        """One INFO line the first time an incident gets actions here: an operator reading a
        worker's log sees what it handled without a line per step."""
        said = self._incidents_said.setdefault(run_id, set())
        for incident in dict.fromkeys(a.incident_id for a in actions if a.incident_id):
            if incident in said or len(said) >= MAX_INCIDENTS_SAID:
                continue
            said.add(incident)
            plan = [a for a in actions if a.incident_id == incident]
            onset = plan[0].incident_onset_step
            log.info(
                "actuator: run %s incident %s (onset step %s): %s at step %d; why: %s",
                run_id,
                incident,
                "?" if onset is None else onset,
                "+".join(dict.fromkeys(a.kind.value for a in plan)),
                plan[0].apply_at_step,
                plan[0].reason or "no reason given",
            )

    def forget(self, run_ids: Iterable[str]) -> None:
        run_ids = list(run_ids)
        super().forget(run_ids)
        for run_id in run_ids:
            self._pulsed.pop(run_id, None)
            self._unpulsed.pop(run_id, None)
            self._incidents_said.pop(run_id, None)

    def _signed(self, actions: list[Action] | None) -> list[Output]:
        topic = self.topics.actions
        if self.signing_key is None:
            return [(topic, a) for a in actions or ()]
        return [(topic, sign_action(a, self.signing_key)) for a in actions or ()]

    def _end_due(self, now: float) -> None:
        ended = self.due_ends(now)
        if ended:
            self.end_runs(ended)

    def tick(self, now: float) -> list[Output]:
        self._end_due(now)
        return self._signed(self._held_pulses(now))

    def _held_pulses(self, now: float) -> list[Action]:
        """Pulses for the decisions the interval held back, once it has passed."""
        due = [
            run_id
            for run_id in self._unpulsed
            if now - self._pulsed.get(run_id, now) >= (self.pulse_interval_s or 0.0)
        ]
        pulses = []
        for run_id in due:
            decision = self._unpulsed.pop(run_id)
            current = self.sessions.state(run_id)  # type: ignore[attr-defined]
            if decision.session and current and decision.session != current:
                continue  # a newer trainer session took the run over: it is not this one's step
            session = decision.session or current
            for pulse in self._pulse(decision, now):
                pulses.append(pulse.model_copy(update={"session": session}) if session else pulse)
        return pulses

    def drain_ignored(self) -> dict[str, int]:
        out = dict(self._ignored)
        self._ignored.clear()
        return out
