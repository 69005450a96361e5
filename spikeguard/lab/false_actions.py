"""What a guard would do to a healthy run, counted: there, every action is a false one.

Three answers per run, each as the live run would have had it:

- the policy's (:func:`policy_actions`): the pipeline's decisions (a
  backtest) handed to the recovery policy as the actuator hands them, with
  the Guard's periodic checkpoints (its default cadence and rotation) and
  each rollback acknowledged as applied where the trainer would apply it;
  counted: stops, rollbacks, LR cuts and skipped batches.
- the Guard's own skip rule (:mod:`spikeguard.lab.local_skips`) over the
  run's ``(loss, grad_norm)``, with the Guard's default settings: local skips.
- a simple trainer rule (:mod:`spikeguard.lab.baselines`): each step it
  flags is one action (OLMo-core, axolotl and metaseq skip the step,
  Lightning and llm-foundry stop the run).

Offline, a rollback cannot re-run the steps it rewinds, so the steps after
it are judged as recorded; on a healthy run the re-run would look alike.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

from spikeguard.actuators.config import PolicyConfig
from spikeguard.actuators.policy import RecoveryPolicy
from spikeguard.lab.baselines import BASELINES, flag_run
from spikeguard.lab.local_skips import LocalSkips
from spikeguard.producers.actions import ANOMALY_KINDS
from spikeguard.producers.config import GuardConfig
from spikeguard.producers.health import HealthTracker
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    AnomalyType,
    CheckpointEvent,
    Decision,
    StepEvent,
)
from spikeguard.schemas.actions import ScaleLrParams, SkipBatchesParams


class PolicyActions(NamedTuple):
    """What the recovery policy did to one run."""

    stops: int
    rollbacks: int
    lr_cuts: int  # SCALE_LR by less than 1, or SET_LR
    skipped_batches: int


class FalseActions(NamedTuple):
    """Every action a guard took on healthy runs (summed over runs), and over how many steps."""

    steps: int
    stops: int
    rollbacks: int
    lr_cuts: int
    skipped_batches: int
    local_skips: int

    def per_10k(self) -> dict[str, float]:
        """Each count per 10,000 steps (``steps`` stays the count)."""
        rate = 10_000 / max(self.steps, 1)
        return {"steps": self.steps, **{f: getattr(self, f) * rate for f in self._fields[1:]}}


class Checkpoints:
    """The Guard's periodic checkpoints as the policy learns of them: every ``every`` steps,
    the newest ``keep`` on disk plus the newest healthy one, the rest announced deleted."""

    def __init__(self, run_id: str, every: int, keep: int) -> None:
        self.run_id, self.every, self.keep = run_id, every, keep
        self.kept: list[CheckpointEvent] = []

    def due(self, step: int, healthy: bool) -> list[CheckpointEvent]:
        if self.every <= 0 or step % self.every:
            return []
        new = CheckpointEvent(
            run_id=self.run_id, step=step, checkpoint_id=f"ckpt-{step}", healthy=healthy, time=0.0
        )
        self.kept.append(new)
        newest = self.kept[-self.keep :]
        newest_healthy = next((c for c in reversed(self.kept) if c.healthy), None)
        kept = [c for c in self.kept if c in newest or c is newest_healthy]
        out = [new] + [c.model_copy(update={"deleted": True}) for c in self.kept if c not in kept]
        self.kept = kept
        return out


def policy_actions(
    decisions: Iterable[Decision],
    run_id: str,
    policy: PolicyConfig | None = None,
    guard: GuardConfig | None = None,
) -> PolicyActions:
    """Hand ``decisions`` (one run's, in step order) to the recovery policy as the live run would."""
    guard = guard or GuardConfig()
    recovery = RecoveryPolicy(policy or PolicyConfig(), run_id=run_id)
    health = HealthTracker(guard.incident_window, guard.healthy_stretch)
    checkpoints = Checkpoints(run_id, guard.checkpoint_every, guard.keep_checkpoints)
    stops = rollbacks = lr_cuts = skipped = 0
    for decision in decisions:
        for event in checkpoints.due(decision.step, health.healthy(decision.step)):
            recovery.on_checkpoint(event)
        actions: list[Action] = recovery.on_decision(decision)
        while actions:
            action = actions.pop(0)
            kind, params = action.kind, action.params
            if kind in ANOMALY_KINDS:
                health.on_anomaly()
            if kind is ActionKind.STOP:
                stops += 1
            elif kind is ActionKind.ROLLBACK:
                rollbacks += 1
                actions += recovery.on_ack(
                    Ack(
                        run_id=run_id,
                        action_id=action.action_id,
                        kind=kind,
                        status=AckStatus.APPLIED,
                        step=action.apply_at_step,
                        time=0.0,
                    )
                )
            elif kind is ActionKind.SET_LR or (
                isinstance(params, ScaleLrParams) and params.factor < 1
            ):
                lr_cuts += 1
            elif isinstance(params, SkipBatchesParams):
                skipped += params.to_step - params.from_step + 1 + params.extra
        if recovery.stopped:
            break
        health.observe(decision.step, decision.type is not AnomalyType.NON_FINITE)
    return PolicyActions(stops, rollbacks, lr_cuts, skipped)


def pipeline_false_actions(
    runs: Iterable[Sequence[StepEvent]], settings=None, guard: GuardConfig | None = None
) -> FalseActions:
    """The pipeline + policy + the Guard's skip rule over healthy runs, summed."""
    from spikeguard.settings import load_settings

    settings = settings or load_settings(env={})
    total = [0] * len(FalseActions._fields)
    for events in runs:
        run = guarded_run(events, settings, guard)
        counts = (len(events), *run.actions, len(run.local_skips))
        total = [a + b for a, b in zip(total, counts)]
    return FalseActions(*total)


class GuardedRun(NamedTuple):
    """One run as the live Guard and its pipeline would have handled it."""

    decisions: list[Decision]  # the pipeline's, having heard of the Guard's skips
    local_skips: list[int]  # steps whose update the Guard's skip rule skipped
    actions: PolicyActions  # what the recovery policy did with the decisions


def guarded_run(
    events: Sequence[StepEvent], settings=None, guard: GuardConfig | None = None
) -> GuardedRun:
    """The pipeline, the policy and the Guard's skip rule over one run's events."""
    from spikeguard.lab.backtest import backtest_events
    from spikeguard.settings import load_settings

    settings = settings or load_settings(env={})
    guard = guard or GuardConfig()
    skips = LocalSkips(guard)
    decisions = backtest_events([skips.live(e) for e in events], settings)
    run_id = events[0].run_id if events else "run"
    actions = policy_actions(decisions, run_id, settings.policy, guard)
    return GuardedRun(decisions, [step for _, step in skips.skipped], actions)


class RuleFlags(NamedTuple):
    """What a simple rule flagged over healthy runs."""

    steps: int
    flagged: int  # steps flagged
    runs_flagged: (
        int  # runs with at least one: for a rule that stops, the runs it would have stopped
    )


def rule_flags(name: str, runs: Iterable[Sequence[StepEvent]]) -> RuleFlags:
    """The simple rule ``name`` (:data:`~spikeguard.lab.baselines.BASELINES`) over healthy runs."""
    steps = flagged = runs_flagged = 0
    for events in runs:
        steps += len(events)
        mine = sum(m.is_anomaly for m in flag_run(BASELINES[name](), events))
        flagged += mine
        runs_flagged += mine > 0
    return RuleFlags(steps, flagged, runs_flagged)
