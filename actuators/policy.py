"""The recovery policy: decisions, checkpoints and acks in; actions out. Pure, one per run.

Fusion's decision says what happened (type, confidence, ``critical``, the
incident, the evidence); the policy alone says what to do about it, choosing
one response per cause (:class:`~spikeguard.actuators.responses.Response`,
named in front of every action's reason). ``PolicyConfig`` maps anomaly types
to strategies, ``decision.critical`` picks ``critical``; all numbers are
settings:

==================  ==========================================================
non-finite          the Guard skipped that update itself: one ALERT. Another
                    within ``non_finite_recur_steps`` -> ROLLBACK,
                    SKIP_BATCHES, SCALE_LR (x0.5), CLIP
LR jump             (rules ``lr_jump``) one ALERT; a loss or gradient anomaly
                    within ``lr_jump_window_steps`` is LR-induced: HOLD_LR (the
                    trainer holds the jump now on at the rate it trained at
                    before it, and gives the schedule back the step it ends);
                    still anomalous after the patience -> ROLLBACK, no skip,
                    HOLD_LR (the re-run holds the jump at the rate it trained
                    at; the schedule comes back exactly when it falls again)
LR-induced rise     (``lr_induced_rise``: the detector saw the LR jump beyond
                    any rate the run had trained at, then the loss rise) HOLD_LR
                    once (as above: nothing lowered, so nothing to restore after
                    the jump); damaged (below) a
                    ``damage_window_steps`` window later -> ROLLBACK to before
                    the jump, no skip, the checkpoint's LR, HOLD_LR
critical            (finite loss) judged after ``spike_patience_steps`` like a
                    spike: absorbed -> watch; still anomalous -> ROLLBACK,
                    SKIP_BATCHES, SCALE_LR (x0.5), CLIP; but if every update of
                    it was bounded (skipped, or its gradient within
                    ``absorbed_grad_ratio`` of the baseline) the data caused it:
                    ROLLBACK, SKIP_BATCHES only. Other critical types: at once
explosion           at once: SCALE_LR (x0.4), CLIP; a recurring one (a later
                    incident) also lowers the restore ceiling
                    (x``lr_ceiling_decrease_factor``); a loss anomaly in the
                    same incident -> rollback
loss-scale          one ALERT: the GradScaler recovers by itself, nothing is
collapse            changed (so nothing is to be restored)
spike               judged ``spike_patience_steps`` later: back to normal ->
                    CHECKPOINT (on_demand) + ALERT (info). Still anomalous
                    with an update of it beyond ``absorbed_grad_ratio`` of
                    its baseline gradient -> ROLLBACK, SKIP_BATCHES (the LR
                    stays unless ``lr_decrease_factor_spike`` < 1). Still
                    anomalous, flat, every known update bounded -> no sign of
                    damage (a harder data level looks the same): one ALERT,
                    its end watched (``flat_rise_waits``; False: roll back
                    and skip, and a re-run that meets the rise again on the
                    batches after the skipped ones calls it the data's
                    level, the LR and clipping given back). A watched rise
                    that ends at once (``bad_stretch_steps``) with the loss
                    still above its level by ``absorbed_loss_margin`` was bad
                    data that damaged the weights -> ROLLBACK, SKIP_BATCHES
                    from its onset to its last elevated step, once
slow                low urgency (inside the run's own wander: the detectors' call)
                    -> one ALERT. Otherwise CHECKPOINT (emergency) + SCALE_LR
                    (x0.8), another x0.8 every ``divergence_step_interval_steps``
                    while it goes on; after ``divergence_max_lr_steps`` steps ->
                    rollback if damaged (below), else one ALERT
preventive          rate-limited CHECKPOINT (on_demand), gentle CLIP; never more
notice              (other types) one ALERT (warning) per incident
outlier step        one ALERT (info): never a recovery
healthy             after ``lr_restore_healthy_steps`` in a row: RESTORE_LR
                    (x1.25), up to the ceiling; not while damaged. After a
                    rollback that skipped the data, once the re-run trained on
                    the batches after the skipped ones with no anomaly: the
                    cause is gone, RESTORE_LR to the checkpoint's LR at once,
                    and the clipping the recovery set lifted (CLIP, mode lift)
==================  ==========================================================

Damaged: after the LR was lowered outside a rollback, the median loss of the
last ``damage_window_steps`` decisions above its level before the incident
(fusion's baseline then) times ``damage_loss_ratio``. A model collapsed to
chance plateaus there, and the detectors relearn the plateau as normal: the
policy does not, so such steps are not healthy and the LR stays down.

A rollback needs a healthy checkpoint at least ``rollback_min_steps_before_onset``
before the incident's onset; without one, a confirmed (critical) incident
falls back to lowering the LR and skipping batches ahead, and says so (ALERT);
an unconfirmed one is watched (one ALERT). One recovery per incident, a
bounded number per window (:mod:`escalation`); a critical decision needing one
more stops the run, anything less is said once and watched. (The bad stretch's
rollback finishes its incident's recovery, whose window was too short; it is
not counted as another.)

Ordering. Fusion emits one decision per step, in step order; within an
*epoch* a decision is new only if its step is past the last one handled
(duplicates and late arrivals produce nothing). A rollback issued at decision
step s to target t opens epoch e+1 when its APPLIED ack arrives: the re-run
repeats steps t+1.. with the same decision ids, and they are handled as new
observations (action ids carry the epoch, so they differ from the first
run's). Decisions for steps after s from the abandoned timeline (the trainer
ran on until it applied the rollback) are ignored, before and after the ack.
Re-run decisions that arrive before the ack count as duplicates (the ack goes
straight to the actuator while decisions pass detectors and fusion, so it is
normally first).
"""

from __future__ import annotations

import json
import math
from statistics import fmean
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

from spikeguard.actuators.config import PolicyConfig
from spikeguard.actuators.escalation import add_escalation
from spikeguard.actuators.incidents import Incident, IncidentBook, PendingSpike
from spikeguard.actuators.seen import SeenDecisions
from spikeguard.actuators.action_plan import ActionPlan
from spikeguard.actuators.mechanisms import MECHANISM_TYPES, answer_mechanism
from spikeguard.actuators.responses import Response
from spikeguard.actuators.controls import Controls, RollbackRecord
from spikeguard.errors import ConfigError, SpikeguardError
from spikeguard.processors.outlier_model import log_of
from spikeguard.processors.robust_stats import MAD_TO_SIGMA, second_difference_spread
from spikeguard.schemas.actions import CheckpointParams, HoldLrParams
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    AnomalyType,
    CheckpointEvent,
    Claim,
    Decision,
    Evidence,
    Urgency,
    WITHHELD,
    action_id,
)

__all__ = ["PolicyConfig", "RecoveryPolicy", "ForeignRunError"]

MAX_ACK_RECORDS = 256
MAX_LR_SENT = 64  # LR changes sent whose acks may still refuse them
MAX_STRETCH_LOSSES = 1024  # elevated losses of a rise called the data's level, kept for its median
#: a watched stretch's damage is looked for in n, 2 n and 4 n losses after it (n:
#: bad_stretch_steps): a noisy loss's damage shows only in a longer look, or only later
DAMAGE_LOOKS = (1, 2, 4)
#: standard errors of a median of the run's own healthy losses a watched stretch must leave the
#: loss above its level at one of those looks, to be damage that is rolled back: 2.8 standard
#: errors of the difference of two such medians (0.2 % one-sided for a Gaussian, per look).
#: Chosen between 4 and 5 on the development probe (tests/actuators/test_responses.py::
#: _stretch_ends and its signed twin, 200 seeds a case) and the user loops' CNN seeds 20-29:
#: at 5, one CNN data fault was left in (+12.7 % at the end) and damage of 1.4 of a loss's
#: noise was found in 79-85 % of runs (4: 90-93 %), for no false rollback in 1,600 healthy
#: positive runs (4: 8); checked on another generator and CNN and seq2seq seeds 30-39
DAMAGE_ERRORS = 4.0
#: blocks of a look's size of the run's latest healthy losses whose medians show how far such a
#: median moves: the run's recent past (a learning curve's first steep steps are not its noise
#: now), at most the ten blocks of the longest look that are kept (eight are the least that
#: give the six second differences their spread is taken from)
HEALTHY_HISTORY_BLOCKS = 20
HEALTHY_KEPT_BLOCKS = 10
_LR_KINDS = (ActionKind.SCALE_LR, ActionKind.RESTORE_LR)
LR_JUMP_RULE = "lr_jump"  # the rules detector's name for "the LR in the steps jumped"
_FAILED = (AckStatus.FAILED, AckStatus.REJECTED, AckStatus.UNHANDLED)
_UNSETTLED = ("pending", "timed_out")


class RerunWindow(NamedTuple):
    """After a rollback that skipped data: the re-run's steps [start, end) that train on the
    batches after the skipped ones, and the checkpoint's step (PaLM's test, _data_level)."""

    start: int
    end: int
    checkpoint_step: int
    clip_given: bool = False  # the recovery left clipping tighter than the checkpoint's ...
    clip_before: float | None = None  # ... which was this (None: none)


def _claim_of(d: Decision) -> dict[str, Any]:
    """An anomalous decision's claim and evidence, kept to back a later action (JSON-able)."""
    return {
        "claim": {"step": d.step, "epoch": d.epoch, "type": d.type.value},
        "evidence": json.loads(d.evidence.model_dump_json()) if d.evidence else None,
    }


def _finite_loss(d: Decision) -> list[float]:
    """The decided step's loss, if its evidence has a finite one: [loss], else []."""
    loss = None if d.evidence is None else d.evidence.loss
    return [loss] if loss is not None and math.isfinite(loss) else []


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _step_noise(values: list[float]) -> float:
    """The step-to-step noise of a loss whose values, in order, are ``values``: a robust standard
    deviation from its first differences (1.4826 of their median size, over sqrt(2)), which a
    trend, however steep, does not widen, so that all of ``values`` can be used."""
    steps = [abs(b - a) for a, b in zip(values, values[1:])]
    return MAD_TO_SIGMA * _median(steps) / math.sqrt(2.0) if steps else 0.0


def _center_error(
    values: list[float], n: int, center: Callable[[list[float]], float], efficiency: float
) -> float:
    """The standard error of ``center`` (a median: ``efficiency`` 1.25; a mean: 1.0) of ``n``
    consecutive losses of a run whose healthy losses, in order, are ``values``: the larger of
    what ``n`` independent points with their step noise give (:func:`_step_noise`; a median's
    error is 1.25 times a mean's, over sqrt(n)) and how far the run's own centers of ``n``
    consecutive losses moved (the spread of their second differences over sqrt(6), so that a
    local straight line, the trend, drops out). Losses alike for a while (batches from one part
    of the data, a slow wander) move a center further than independent points do; the run's
    past says how far, whatever the noise's shape or correlation."""
    error = efficiency * _step_noise(values) / math.sqrt(n)
    centers = [center(values[i : i + n]) for i in range(len(values) % n, len(values) - n + 1, n)]
    spread = second_difference_spread(centers)
    return error if spread is None else max(error, spread / math.sqrt(6.0))


def _grad_ratio(d: Decision) -> float | None:
    """The decided step's gradient norm over its baseline (None: not in the evidence)."""
    e = d.evidence
    if e is None or e.grad_norm is None or not e.grad_norm_baseline:
        return None
    return e.grad_norm / e.grad_norm_baseline if math.isfinite(e.grad_norm) else math.inf


class ForeignRunError(SpikeguardError, ValueError):
    """An event for another run reached this run's policy (the stage routes by run_id)."""


class RecoveryPolicy:
    def __init__(self, config: PolicyConfig | None = None, run_id: str | None = None) -> None:
        if not run_id:
            raise ConfigError("RecoveryPolicy needs a run_id")
        self.config = config or PolicyConfig()
        self.run_id = run_id
        cfg = self.config
        self.recovery = Controls(cfg)
        self.incidents = IncidentBook(run_id, cfg.max_incidents)
        self.epoch = 0  # rollbacks applied so far
        self.high_water = -1  # newest step handled in this epoch
        # Decisions admitted, across epochs: the policy's clock, in observed steps (a re-run
        # after a rollback counts again: that is training time spent).
        self.observed_steps = 0
        self.seen = SeenDecisions()  # decision ids admitted this epoch, within the window
        self.tail: list[int] | None = None  # (lo, hi]: abandoned-timeline steps still to ignore
        self.pending_spike: PendingSpike | None = None
        self.last_non_finite_tick: int | None = (
            None  # observed step of the latest non-finite decision
        )
        self.lr_jump_tick: int | None = None  # observed step of an LR jump not yet answered
        self.lr_hold_until: int | None = None  # no LR restore before this observed step
        self.lr_jump_harmful = (
            False  # an LR jump needed a rollback: the next is scaled back at once
        )
        self.explosions = 0  # gradient-explosion incidents answered: the second lowers the ceiling
        # Damage: the loss level before the LR was lowered outside a rollback (the first such
        # incident's baseline), and the recent losses compared with it. An LR-induced incident is
        # judged on them once a window followed its scale-back (lr_damage: its claim).
        self.level_before: float | None = None
        self.recent_losses: list[float] = []
        # The run's last HEALTHY_KEPT_BLOCKS longest looks' healthy losses, in order, kept
        # across rollbacks (the run's noise, not its timeline): how far a median of them moves.
        self.healthy_losses: list[float] = []
        self.lr_damage: dict[str, Any] | None = None  # incident, since, claim, evidence
        self.rerun_window: RerunWindow | None = None
        self.rerun_troubled = False  # an anomaly on the re-run before it passed its window
        self.data_level_until: int | None = None  # non-critical rises watched until this tick
        # A rise called the data's level, watched for its end (_bad_stretch): its incident, the
        # loss level before it, its elevated losses, its last elevated step, the healthy losses
        # since.
        self.stretch: dict[str, Any] | None = None
        self.healthy_streak = 0
        self.last_preventive_tick: int | None = None
        self.stopped = False
        self.acks: OrderedDict[str, str] = OrderedDict()  # action id -> last status seen
        # A recovery is judged only on steps after it took effect: its actions' incident until an
        # ack says it was applied, then where ([epoch, step]; step -1: all of a rollback's epoch).
        self.recovery_actions: OrderedDict[str, str] = OrderedDict()  # action id -> incident
        self.recovered_at: OrderedDict[str, list[int] | None] = OrderedDict()  # incident -> where
        self.counts = {"duplicate": 0, "late": 0, "abandoned": 0}
        # LR changes sent outside a rollback's plan, by action id: their factor. The trainer may
        # refuse one (its own statistics found the step normal, its mode or budget): then the
        # factor is taken back out, so that the policy's LR stays the trainer's.
        self.lr_sent: OrderedDict[str, float] = OrderedDict()

    # --- inputs -------------------------------------------------------------------------
    def on_decision(self, decision: Decision) -> list[Action]:
        actions = self._on_decision(decision)
        if not any(a.kind is ActionKind.ROLLBACK for a in actions):  # a rollback's: its record's
            for a in actions:
                if a.kind in _LR_KINDS:
                    self.lr_sent[a.action_id] = float(a.params["factor"])
            while len(self.lr_sent) > MAX_LR_SENT:
                self.lr_sent.popitem(last=False)
        return actions

    def _on_decision(self, decision: Decision) -> list[Action]:
        self._check_run(decision.run_id)
        if self.stopped:
            return []
        plan = ActionPlan(
            self.run_id,
            decision.decision_id,  # the cause: the actions' ids derive from it
            self.epoch,
            decision.step + self.config.apply_lag_steps,
            decision_id=decision.decision_id,
            incident_id=decision.incident_id,
            evidence=decision.evidence,
            claim=Claim(step=decision.step, epoch=decision.epoch, type=decision.type),
            incident_onset_step=decision.incident_onset_step if decision.incident_id else None,
        )
        if not self._admit(decision, plan):
            return plan.actions()  # empty, or the alert of an unacknowledged rollback
        if decision.type is AnomalyType.OUTLIER_STEP and not decision.critical:
            # One step far out. Said, never recovered from; nor is it a pending spike's
            # continuation (that would be a second elevated step: a loss_spike). Whether the
            # Guard's local rule skipped that update is in its step event (skip_reason), which
            # the decision does not carry: the alert does not claim it.
            plan.response = Response.OUTLIER_STEP
            plan.alert(
                "info",
                f"outlier step at {decision.step}: one step far outside the run's "
                "noise; no recovery (the Guard's local outlier rule decides whether its "
                "update is skipped: if it was, the trainer's log says 'skipped the update of "
                f"step {decision.step}', and the step event's skip_reason is outlier_step)",
                "outlier_step: an isolated step needs no recovery",
            )
            return plan.actions()
        self._remember_loss(decision)
        if self._bad_stretch(plan, decision):
            return plan.actions()
        if decision.is_anomaly and self.rerun_window is not None:
            self.rerun_troubled = True
        if self._judge_lr_damage(plan, decision):
            return plan.actions()
        p = self.pending_spike
        if p is not None and decision.is_anomaly and decision.step < p.judge_at:
            p.harmless = p.harmless and self._harmless(decision)
            p.unbounded = p.unbounded or self._unbounded(decision)
            p.losses += _finite_loss(decision)
        if self._judge_spike(plan, decision):
            return plan.actions()
        if decision.type in MECHANISM_TYPES and decision.is_anomaly:
            self.healthy_streak = 0  # the LR cut is restored once the signals have calmed
            answer_mechanism(plan, decision, self.recovery, self.config)
        elif decision.preventive or decision.type in self.config.preventive_types:
            self._preventive(plan, decision)
        elif decision.is_anomaly:
            self._anomaly(plan, decision)
        else:
            self._healthy(plan, decision)
        return plan.actions()

    def on_checkpoint(self, event: CheckpointEvent) -> list[Action]:
        self._check_run(event.run_id)
        self.recovery.book.add(event)
        if (oldest := self.recovery.book.oldest_step) is not None:
            self.recovery.lr.forget_before(oldest)
            self.recovery.clip.forget_before(oldest)
        return []

    def on_ack(self, ack: Ack) -> list[Action]:
        self._check_run(ack.run_id)
        if self.stopped:
            return []
        previous = self.acks.get(ack.action_id)
        self.acks[ack.action_id] = ack.status.value
        self.acks.move_to_end(ack.action_id)
        while len(self.acks) > MAX_ACK_RECORDS:
            self.acks.popitem(last=False)
        plan = ActionPlan(
            self.run_id, ack.action_id, self.epoch, ack.step + self.config.apply_lag_steps
        )
        record = self.recovery.record_of(ack.action_id)
        refused_lr = self.lr_sent.pop(ack.action_id, None) if ack.status in _FAILED else None
        if refused_lr is not None:
            lr = self.recovery.lr
            lr.set(max(ack.step, lr.log[-1][0] if lr.log else 0), lr.current / refused_lr)
        if record is not None:
            self._rollback_ack(plan, record, ack)
        elif (
            ack.status in _FAILED
            and previous not in {s.value for s in _FAILED}
            and ack.kind not in (ActionKind.ALERT, ActionKind.STOP)
        ):
            plan.alert(
                "warning",
                f"{ack.kind.value} action {ack.action_id} {ack.status.value} "
                f"at step {ack.step}: {ack.result or 'no detail'}",
            )
        if ack.status is AckStatus.APPLIED or ack.status in _FAILED:
            incident = self.recovery_actions.pop(ack.action_id, None)
            if incident is not None and self.recovered_at.get(incident, []) is None:
                # its first action answered: the steps after it judge the recovery (all of the
                # epoch a rollback opened)
                rolled = record is not None and record.status == "applied"
                self.recovered_at[incident] = [self.epoch, -1 if rolled else ack.step]
        return plan.actions()

    # --- ordering, duplicates, epochs ------------------------------------------------------
    def _admit(self, d: Decision, plan: ActionPlan) -> bool:
        """True when ``d`` is a new observation of the current timeline."""
        pending = self.recovery.pending()
        if pending is not None and d.step > pending.issue_step:
            if d.step - pending.issue_step <= self.config.rollback_ack_timeout_steps:
                self.counts["abandoned"] += 1  # the trainer runs on until it applies the rollback
                self.high_water = max(self.high_water, d.step)
                return False
            pending.status = "timed_out"
            plan.alert(
                "warning",
                f"rollback {pending.action_id} (decision step "
                f"{pending.issue_step}) not acknowledged {d.step - pending.issue_step} "
                "steps later; handling decisions again",
            )
        if self.tail is not None and self.tail[0] < d.step <= self.tail[1]:
            self.counts["abandoned"] += 1
            return False
        self.tail = None  # the re-run has begun (or gone past the abandoned steps)
        if d.step <= self.high_water:
            self.counts["duplicate" if d.decision_id in self.seen else "late"] += 1
            return False
        self.high_water = d.step
        self.seen.add(d.decision_id, d.step, self.config.seen_window_steps)
        self.observed_steps += 1
        return True

    def _rollback_ack(self, plan: ActionPlan, record: RollbackRecord, ack: Ack) -> None:
        target = f"rollback to {record.checkpoint_id} (step {record.target_step})"
        # Only APPLIED counts: the guard also answers DUPLICATE for a redelivered copy of an
        # action that is still pending, so DUPLICATE says nothing about the rollback having run.
        if ack.status is AckStatus.APPLIED and record.status in _UNSETTLED:
            self.recovery.applied(record)
            self.epoch += 1
            self.high_water = record.target_step
            self.seen.clear()
            self.tail = [record.issue_step, max(record.issue_step, ack.step)]
            self.pending_spike = None
            self.healthy_streak = 0
            self.recent_losses = []  # the abandoned timeline's
            self.rerun_troubled = False
            self.rerun_window = (
                None
                if record.skipped_from is None
                else RerunWindow(
                    record.skipped_from,
                    record.skipped_from + record.skipped,
                    record.target_step,
                    record.clip_given,
                    record.clip_before,
                )
            )
        elif ack.status in _FAILED and record.status in _UNSETTLED:
            self.recovery.failed(record, refused=ack.status is AckStatus.REJECTED)
            record.alerted = True
            if ack.result.startswith(WITHHELD):  # the trainer's mode or budget: it acts on nothing
                plan.alert(
                    "critical",
                    f"{target} withheld by the trainer ({ack.result[len(WITHHELD) :]});"
                    " not retried: what follows is reported, and the trainer applies none of it",
                )
            else:
                plan.alert(
                    "critical",
                    f"{target} {ack.status.value}: {ack.result or 'no detail'}; "
                    "not retried, a further need stops the run",
                )
        elif ack.status in _FAILED and record.status == "applied" and not record.alerted:
            record.alerted = True
            plan.alert(
                "critical",
                f"{target} applied on one rank but {ack.status.value} "
                f"on rank {ack.rank}: ranks disagree",
            )

    # --- strategies --------------------------------------------------------------------------
    def _anomaly(self, plan: ActionPlan, d: Decision) -> None:
        cfg = self.config
        self.healthy_streak = 0
        inc = self.incidents.get(d, self.observed_steps)
        strategy = cfg.strategy_of(d.type, d.critical)
        if self._within_wander(d):
            strategy = "wander"  # a rise the run's own wander explains: said, never answered
        is_loss = d.type in cfg.loss_types
        what = f"{d.type.value} at step {d.step} (confidence {d.confidence:.2f})"
        grace = inc.in_grace(self.observed_steps, cfg.recovery_grace_steps)
        if d.type is AnomalyType.NON_FINITE:
            self._non_finite(plan, d, inc, what, grace)
        elif AnomalyType.LR_INDUCED_RISE.value in d.rules:
            self._lr_induced_rise(plan, d, inc, what)
        elif LR_JUMP_RULE in d.rules:
            self._lr_jump(plan, d, inc, what)
        elif self._lr_induced(plan, d, inc, what, strategy) or inc.lr_induced:
            self._after_lr_jump(plan, d, inc, what, strategy, grace)
        elif d.type is AnomalyType.LOSS_SCALE_COLLAPSE:
            if not inc.noticed:
                inc.noticed = True
                plan.response = Response.LOSS_SCALE_WATCHED
                plan.alert(
                    "warning",
                    f"{what}: the GradScaler skips overflowing updates and regrows "
                    "its scale by itself; watching, nothing changed",
                )
        elif strategy in ("spike", "slow") and self._data_level(plan, d, inc, what):
            pass
        elif is_loss and inc.explosion_handled and not grace:
            plan.response = Response.UNSTABLE
            self._recover(
                plan,
                d,
                inc,
                cfg.lr_decrease_factor_explosion,
                True,
                f"{what} after a gradient explosion in the same incident",
            )
        elif strategy == "critical" and is_loss and not grace:
            # A finite extreme loss: judged after the spike's patience like any spike. One the run
            # absorbed by then (its own clipping bounded the update) needs no rollback.
            if self.pending_spike is None:
                self._pend(d, inc, critical=True)
        elif strategy == "critical" and not grace:
            plan.response = Response.CRITICAL
            self._recover(plan, d, inc, cfg.lr_decrease_factor_critical, True, f"critical {what}")
        elif strategy == "explosion" and not grace:
            if inc.loss_seen:
                plan.response = Response.UNSTABLE
                self._recover(
                    plan,
                    d,
                    inc,
                    cfg.lr_decrease_factor_explosion,
                    True,
                    f"{what} with the loss already following",
                )
            elif not inc.explosion_handled:
                self._explosion(plan, d, inc, what)
        elif strategy == "spike" and self.stretch and self.stretch["incident"] == inc.key:
            pass  # a flat rise being watched for its end (_watch_flat_rise)
        elif strategy == "spike" and not grace and self.pending_spike is None:
            self._pend(d, inc, critical=False)
        elif strategy == "wander" and not inc.noticed:
            inc.noticed = True
            plan.response = Response.SLOW_WATCHED
            plan.alert(
                "info",
                f"{what}: low urgency (within the run's own wander at that time scale); "
                "watching, nothing changed",
            )
        elif strategy == "slow" and not grace:
            plan.response = Response.SLOW_RISE
            self._slow(plan, d, inc, what)
        elif strategy == "notice" and not inc.noticed:
            inc.noticed = True
            plan.response = Response.NOTICE
            plan.alert(
                "warning",
                f"{what}: watching, no action",
                f"{what}: no recovery strategy for this type",
            )
        inc.loss_seen = inc.loss_seen or is_loss

    def _data_level(self, plan: ActionPlan, d: Decision, inc: Incident, what: str) -> bool:
        """A rise that is the data's level, not a bad batch: watched. True if so.

        PaLM's test: the rollback skipped the batches that led into the rise, and the re-run
        meets the same rise on the batches after them. Rolling back again cannot help (the
        data itself is harder now); the LR the rise lowered and the clipping its recovery set
        are given back, and non-critical rises are watched while the detectors relearn the
        level, as are critical ones whose every update was bounded (:meth:`_judge_spike` asks:
        the optimizer was never unstable, so the loss is the data's, however far up). Other
        critical ones still act. The watched rise's end is judged (:meth:`_bad_stretch`): a
        stretch of bad data that stops and left damage is rolled back then, exactly.
        """
        cfg = self.config
        if self.data_level_until is not None and self.observed_steps < self.data_level_until:
            self._watch(plan, inc, f"{what}: the data's level changed (said before)")
            return True
        window = self.rerun_window
        if window is None or not window.start <= inc.onset_step < window.end:
            return False
        self.rerun_window = None
        self.data_level_until = self.observed_steps + cfg.data_level_hold_steps
        self._start_stretch(d, inc)
        inc.watched = True
        plan.response = Response.DATA_LEVEL
        why = (
            f"{what}: the rise came back on other data (steps {window.start}..{window.end - 1} of "
            "the re-run train on the batches after the skipped ones): the data's level changed, "
            f"not a bad batch; no rollback, non-critical rises watched for "
            f"{cfg.data_level_hold_steps} steps"
        )
        lr = self.recovery.lr
        before = lr.at(window.checkpoint_step)  # the LR at the checkpoint, before the rise
        if before > lr.current:
            self.recovery.restore_lr(
                plan, f"{why}; the LR the rise lowered given back", before / lr.current
            )
        if window.clip_given:  # set for a bad batch that was not one
            self.recovery.lift_clip(
                plan, f"{why}; the clipping its recovery set lifted", window.clip_before
            )
        plan.alert("warning", why)
        return True

    def _within_wander(self, d: Decision) -> bool:
        """A slow type the detectors call low urgency: the level moved within the run's own
        wander at that time scale (a level shift, flat), which is no more sign of damage than a
        spike that stays up (:meth:`_anomaly` only says it)."""
        return self.config.strategy_of(d.type, d.critical) == "slow" and d.urgency is Urgency.LOW

    def _watch_flat_rise(
        self, plan: ActionPlan, d: Decision, inc: Incident, still: str, p: PendingSpike
    ) -> None:
        """A spike still elevated after its patience, not rising further, no update of it known
        to go beyond absorbed_grad_ratio: nothing says the weights are damaged. A harder data
        level (a curriculum stage, a new mixture) and a stretch of bad batches are the same
        observation now; they differ at their end: a level stays, bad data stops. So no
        rollback now: its rise is watched like the data's level, and if it ends at once
        (:meth:`_bad_stretch`), its batches are rolled back and skipped then, exactly."""
        self._start_stretch(d, inc, earlier=p.losses)
        inc.watched = True
        plan.response = Response.FLAT_RISE
        plan.alert(
            "warning",
            f"{still}, but flat, and no update of it beyond x{self.config.absorbed_grad_ratio:g} "
            "its baseline gradient: no sign the weights are damaged (a harder data level looks "
            "the same); no rollback. If it ends at once, as bad data does, its batches are rolled "
            f"back and skipped then; watched for {self.config.data_level_hold_steps} steps",
        )

    def _start_stretch(
        self, d: Decision, inc: Incident, earlier: list[float] | None = None
    ) -> None:
        """Watch ``inc``'s rise for its end (:meth:`_bad_stretch`) until data_level_hold_steps on;
        ``earlier``: the rise's losses before ``d`` (its pending spike's)."""
        loss, base = (
            (None, None) if d.evidence is None else (d.evidence.loss, d.evidence.loss_baseline)
        )
        if loss is None or base is None or not (math.isfinite(loss) and math.isfinite(base)):
            return
        losses = [*(earlier or ()), loss]
        n = self.config.bad_stretch_steps
        self.stretch = {
            "incident": inc.key,
            "baseline": base,  # fusion's, from the steps before the rise
            "elevated": list(losses),
            "recent": losses[-2 * n :],
            "looks": self._damage_looks(base),
            "marks": [{"step": d.step, "loss": loss, **_claim_of(d)}],
            "last": d.step,
            "until": self.observed_steps + self.config.data_level_hold_steps,
            **_claim_of(d),
        }

    def _damage_looks(self, base: float) -> list[list[float]]:
        """For each look at a stretch's damage (DAMAGE_LOOKS): the number of losses it takes,
        the loss's level just before the rise measured as the losses after it will be, from
        that many healthy losses (fusion's baseline lags a loss that falls or wanders), the bar
        the losses after must clear, and whether the look is in log space (1) or not (0).

        A positive loss is looked at in log space, on the mean of its logs: its noise is a
        multiple of its level, so the logs' spread is the same whatever the level, and a mean
        uses every loss where a median uses the middle one (a CNN whose batch loss is as noisy
        as its level doubled its median after a data fault, 3 of its standard errors; the mean
        of its logs rose 5.6). The bar is DAMAGE_ERRORS standard errors of such a mean
        (:func:`_center_error`, the run's own) and at least ``absorbed_loss_margin`` of the
        level. A loss that goes below zero has no logs and no scale but its noise: the median
        of its losses, DAMAGE_ERRORS standard errors of such a median, at least its step noise
        (a longer median sees a smaller offset, but one within a step's noise is not worth a
        rollback), and the margin of its level (:meth:`_bad_stretch`)."""
        n, healthy = self.config.bad_stretch_steps, self.healthy_losses
        if len(healthy) < 5:
            return [[n, base, 0.0]]
        center: Callable[[list[float]], float]
        if min(healthy) > 0:  # the mean of its logs, at least the margin of its level
            values, center, efficiency, in_logs = [log_of(v) for v in healthy], fmean, 1.0, 1
            floor = math.log1p(self.config.absorbed_loss_margin)
        else:  # medians, at least its step noise
            values, center, efficiency, in_logs = healthy, _median, 1.25, 0
            floor = _step_noise(healthy)
        return [
            [
                k,
                center(values[-k:]),
                max(
                    DAMAGE_ERRORS
                    * _center_error(values[-HEALTHY_HISTORY_BLOCKS * k :], k, center, efficiency),
                    floor,
                ),
                in_logs,
            ]
            for k in (n * m for m in DAMAGE_LOOKS)
        ]

    def _bad_stretch(self, plan: ActionPlan, d: Decision) -> bool:
        """A watched rise that ended as it began, leaving the weights damaged: a stretch of bad
        batches. True if it rolled back.

        A harder data level and a stretch of bad batches look the same while they last (a flat
        rise with bounded updates; or, after a rollback skipped its window, the rise met again
        on the batches after it: PaLM's re-run test). Their ends differ: a level stays, or
        fades as the run learns it; bad data stops. So a watched rise is judged once when it
        ends *at once*: the median of the last ``bad_stretch_steps`` losses has fallen at least
        half the way from the median of the (up to) as many before them to the level before
        the rise, those still up by at least a quarter of the rise (a long stretch's level
        drifts as the run fits its data; a faded level is over, not ended). Then, if the n, 2 n
        or 4 n losses after its last elevated step (n: ``bad_stretch_steps``) are above as many
        healthy losses before its onset (a positive loss: the mean of their logs; one below
        zero: their median) by more than ``absorbed_loss_margin`` of the level and
        DAMAGE_ERRORS standard errors (:meth:`_damage_looks`), the stretch damaged the weights: its batches
        (its onset to its last elevated step above the middle of the fall) are rolled back and
        skipped, the LR and clipping left as they are. Back at its level at all three looks,
        nothing is undone (a harder stretch of data that ended, or bad data the run absorbed). A
        fading level comes down step by step, never by half its height within twice
        ``bad_stretch_steps``; an interleaved one keeps its median up.
        """
        w = self.stretch
        if w is None:
            return False
        until = w.get("until", self.data_level_until)
        if until is None or self.observed_steps >= until:
            self.stretch = None  # the watch is over: a later fall is the run's own
            return False
        loss = None if d.evidence is None else d.evidence.loss
        if loss is None or not math.isfinite(loss):
            return False
        if d.is_anomaly:
            w["elevated"].append(loss)
            del w["elevated"][: max(0, len(w["elevated"]) - MAX_STRETCH_LOSSES)]
        base = w["baseline"]
        rise = _median(w["elevated"]) - base
        if not rise > 0:
            return False
        n = self.config.bad_stretch_steps
        recent = w.setdefault("recent", [])
        recent.append(loss)
        del recent[: max(0, len(recent) - 2 * n)]
        if d.is_anomaly:  # the stretch's elevated steps of that span, to back a rollback with
            marks = w.setdefault("marks", [])
            marks.append({"step": d.step, "loss": loss, **_claim_of(d)})
            del marks[: max(0, len(marks) - 2 * n)]
        looks = w.get("looks") or [[n, base, 0.0]]
        if "after" not in w:
            if len(recent) <= n:
                return False
            before, back = _median(recent[:-n]), _median(recent[-n:])
            # How far up it still was (a long stretch's level can drift), at most its own rise:
            # ``before`` may be a few points, the stretch's noisiest.
            high = min(before - base, rise)
            if high < rise / 4 or back > base + high / 2:
                return False  # not over, or not at once
            # Its last step: the last elevated one still above the middle of the fall.
            up = [m for m in w.get("marks", ()) if m["loss"] > base + high / 2]
            if up:
                w.update(last=up[-1]["step"], claim=up[-1]["claim"], evidence=up[-1]["evidence"])
            # The level after it is a median of losses after its last step, those alone: the
            # window that saw the fall still holds some of the stretch, and its median, the
            # largest of the losses after it, called noise damage.
            since = d.step - w["last"]
            w["after"] = list(recent[-since:]) if 0 < since <= len(recent) else []
            w["middle"] = base + high / 2
            w["look"] = 0
            w["until"] = max(until, self.observed_steps + int(looks[-1][0]) + 1)
        elif d.step > w["last"]:
            w["after"].append(loss)
        look = w.get("look", 0)
        if len(w["after"]) < looks[look][0]:
            return False
        k, level, bar, *in_logs = looks[look]
        logs = bool(in_logs and in_logs[0])  # a positive loss's look: means of its logs
        if logs:
            after, margin = fmean([log_of(v) for v in w["after"][: int(k)]]), bar
        else:
            after = _median(w["after"][: int(k)])
            # Damaged: still up by the absorbed margin of its level, and by the look's bar (a
            # level near zero, a signed loss's, has no margin of its own: its noise alone decides).
            margin = max(self.config.absorbed_loss_margin * abs(level), bar)
        if (math.exp(after) if logs else after) > w.get("middle", math.inf):
            # Back above the middle of its fall: it had not ended (a noisy stretch's median of
            # ten dips half way by chance), and the losses taken for "after" are its own.
            # Watched on for its real end.
            del w["after"]
            return False
        if after <= level + margin and look + 1 < len(looks):
            w["look"] = look + 1
            return False  # not yet: a longer look may show what this one cannot
        self.stretch = None  # judged
        inc = self.incidents.incidents.get(w["incident"]) or self.incidents.get(
            d, self.observed_steps
        )
        shown, center = (math.exp(level), "geometric mean") if logs else (level, "median")
        ended = (
            f"the rise from step {inc.onset_step} (the level before it {shown:.4g}, the rise "
            f"{base + rise:.4g}) ended at step {w['last']} at once, as bad data stops and a "
            f"harder level does not; the {center} of the {k:g} losses after it "
            f"{math.exp(after) if logs else after:.4g}"
        )
        over = (
            f"more than x{math.exp(margin):.3g} its level (the larger of x"
            f"{1.0 + self.config.absorbed_loss_margin:g} and {DAMAGE_ERRORS:g} standard errors "
            "of the mean of its logs)"
            if logs
            else f"more than {margin:.4g} above its level (x"
            f"{self.config.absorbed_loss_margin:g} of it and {DAMAGE_ERRORS:g} standard errors "
            "of its median; a loss below zero its step noise)"
        )
        if after <= level + margin:
            within = f"x{math.exp(margin):.3g}" if logs else f"{margin:.4g}"
            plan.alert(
                "info", f"{ended}: within {within} of its level (its noise), nothing to undo"
            )
            return False
        plan.incident_id, plan.incident_onset_step = inc.key, inc.onset_step
        # The claim the trainer checks against its own numbers: the last elevated step it saw,
        # not this healthy one.
        plan.claim = Claim.model_validate(w["claim"])
        plan.evidence = Evidence.model_validate(w["evidence"]) if w["evidence"] else None
        plan.response = Response.BAD_STRETCH
        self._recover(
            plan,
            d,
            inc,
            None,
            False,
            f"{ended}, and still {over}: a stretch of bad batches that damaged the weights",
            confirmed=False,
            skip_to=w["last"],
            widening=True,
        )
        return True

    def _pend(self, d: Decision, inc: Incident, critical: bool) -> None:
        self.pending_spike = PendingSpike(
            incident=inc.key,
            onset=inc.onset_step,
            start=d.step,
            judge_at=d.step + self.config.spike_patience_steps,
            critical=critical,
            harmless=self._harmless(d),
            unbounded=self._unbounded(d),
            losses=_finite_loss(d),
            **_claim_of(d),
        )

    def _harmless(self, d: Decision) -> bool:
        """The decided step's update left the weights about as they were: the trainer skipped it
        (the rules say so from its step event), or its gradient norm is known and within
        absorbed_grad_ratio of its baseline."""
        if d.signals.get("update_skipped"):
            return True
        ratio = _grad_ratio(d)
        return ratio is not None and ratio <= self.config.absorbed_grad_ratio

    def _unbounded(self, d: Decision) -> bool:
        """The decided step's update went beyond absorbed_grad_ratio of its baseline gradient:
        known evidence that it moved the weights far (a skipped update moved nothing)."""
        if d.signals.get("update_skipped"):
            return False
        ratio = _grad_ratio(d)
        return ratio is not None and ratio > self.config.absorbed_grad_ratio

    def _absorbed(self, p: PendingSpike, d: Decision) -> bool:
        """Whether a pending extreme loss left the run as it was: its update was skipped or its
        gradient stayed bounded, and the loss is back at the baseline. Without the evidence to
        tell, it was not."""
        cfg, e = self.config, d.evidence
        if not p.harmless or e is None:
            return False
        if e.loss is None or e.loss_baseline is None or not math.isfinite(e.loss):
            return False
        # (a margin of the baseline's size: a loss below zero has its baseline below zero too)
        return e.loss <= e.loss_baseline + cfg.absorbed_loss_margin * abs(e.loss_baseline)

    def _non_finite(
        self, plan: ActionPlan, d: Decision, inc: Incident, what: str, grace: bool
    ) -> None:
        """The Guard skips a non-finite update itself; only a recurring one is recovered from."""
        cfg, last = self.config, self.last_non_finite_tick
        self.last_non_finite_tick = self.observed_steps
        if not cfg.non_finite_skipped_by_trainer:
            if not grace:
                plan.response = Response.CRITICAL
                self._recover(
                    plan, d, inc, cfg.lr_decrease_factor_critical, True, f"critical {what}"
                )
                if not self.stopped:
                    self.recovery.raise_eps(plan, f"critical {what}")
            return
        if last is None or self.observed_steps - last > cfg.non_finite_recur_steps:
            plan.response = Response.NON_FINITE_SKIPPED
            plan.alert(
                "warning",
                f"{what}: the Guard skips a non-finite update itself; no recovery "
                f"unless it recurs within {cfg.non_finite_recur_steps} steps",
            )
            return
        if grace:
            return
        plan.response = Response.NON_FINITE_RECURRING
        why = f"critical {what}, non-finite again {self.observed_steps - last} steps after the last"
        self._recover(plan, d, inc, cfg.lr_decrease_factor_critical, True, why)
        if not self.stopped:
            self.recovery.raise_eps(plan, why)

    def _lr_jump(self, plan: ActionPlan, d: Decision, inc: Incident, what: str) -> None:
        """An LR jump alone changes nothing (a warm restart looks the same); a rise after it does,
        and so does a jump again after one that needed a rollback (the schedule repeats it): then
        a rise in its incident is the LR's too, rolled back without skipping the data."""
        cfg = self.config
        if self.lr_jump_harmful:
            plan.response = Response.LR_INDUCED
            inc.lr_induced = True
            self._watch_lr_damage(d, inc)
            self.lr_hold_until = self.observed_steps + cfg.lr_jump_hold_steps
            self.recovery.lower_lr(
                plan,
                cfg.lr_jump_factor,
                f"{what}: the learning rate jumped again "
                "after a jump that needed a rollback: back towards the schedule's "
                f"trend at once, no restore for {cfg.lr_jump_hold_steps} steps",
            )
            return
        self.lr_jump_tick = self.observed_steps
        plan.response = Response.LR_JUMP_WATCHED
        plan.alert(
            "warning",
            f"{what}: the learning rate jumped; watching: it is scaled back only "
            f"if the loss or the gradient rises within {self.config.lr_jump_window_steps} steps",
        )

    def _lr_induced(
        self, plan: ActionPlan, d: Decision, inc: Incident, what: str, strategy: str
    ) -> bool:
        """A loss or gradient rise shortly after an LR jump: hold the jump (HOLD_LR). True if it
        answered it."""
        cfg, jump = self.config, self.lr_jump_tick
        if jump is None or self.observed_steps - jump > cfg.lr_jump_window_steps:
            return False
        if strategy not in ("critical", "explosion", "spike", "slow"):
            return False
        self.lr_jump_tick = None  # answered: one scale-back per jump
        inc.lr_induced = True
        self._watch_lr_damage(d, inc)
        plan.response = Response.LR_INDUCED
        self.lr_hold_until = self.observed_steps + cfg.lr_jump_hold_steps
        self._hold_jump(
            plan, f"{what}, {self.observed_steps - jump} steps after the learning rate jumped"
        )
        return True

    def _hold_jump(self, plan: ActionPlan, why: str) -> None:
        """The cause is the schedule's jump, and the model not (yet) damaged: the trainer holds the
        jump now on at the rate it trained at before it and gives the schedule back the step the
        jump ends. A factor would outlast the jump (x0.1 restored x1.25 per 200 healthy steps
        left a character GRU at 0.24x its schedule, +7 % final loss); the policy's LR factor is
        untouched, so there is nothing to restore."""
        plan.add(
            HoldLrParams(),
            f"{why}: the jump held at the highest LR the run trained at before it, the "
            "schedule given back when it falls to that rate",
        )

    def _lr_induced_rise(self, plan: ActionPlan, d: Decision, inc: Incident, what: str) -> None:
        """The detector saw the LR jump beyond any rate the run had trained at (no warm restart)
        and the loss rise after it: hold the jump once (HOLD_LR). The data is fine, so nothing
        is rolled back; no restore while the rise is said, nor ``lr_jump_hold_steps`` after."""
        cfg = self.config
        answered = inc.lr_induced or (
            self.lr_hold_until is not None and self.observed_steps < self.lr_hold_until
        )
        self.lr_hold_until = self.observed_steps + cfg.lr_jump_hold_steps
        self.lr_jump_tick = None  # the jump is answered here
        if answered:
            return
        inc.lr_induced = True
        plan.response = Response.LR_INDUCED
        self._watch_lr_damage(d, inc)
        self._hold_jump(
            plan,
            f"{what}: the loss rose after the learning rate jumped beyond any rate "
            "the run had trained at",
        )

    def _after_lr_jump(
        self, plan: ActionPlan, d: Decision, inc: Incident, what: str, strategy: str, grace: bool
    ) -> None:
        """An LR-induced incident: the jump is already held. An explosion gets clipping; a loss
        still anomalous after the patience is rolled back to before the jump (no data skip: the
        data is fine; the re-run holds the jump)."""
        plan.response = Response.LR_INDUCED
        if strategy == "explosion" and not inc.explosion_handled:
            inc.explosion_handled = True
            self.recovery.tighten_clip(plan, f"{what} after an LR jump", resend=True)
        elif strategy in ("critical", "spike", "slow") and not grace and self.pending_spike is None:
            self._pend(d, inc, critical=d.critical)

    def _explosion(self, plan: ActionPlan, d: Decision, inc: Incident, what: str) -> None:
        cfg, rec = self.config, self.recovery
        inc.explosion_handled = True
        self.explosions += 1
        if self.explosions == 1:
            plan.response = Response.EXPLOSION
        else:
            plan.response = Response.RECURRING_EXPLOSION
            ceiling = rec.lr.lower_ceiling(cfg.lr_ceiling_decrease_factor)
            what = f"{what}, explosion #{self.explosions}: LR restores now stop at {ceiling:.3g} of base"
        self._remember_level(d)
        rec.lower_lr(plan, cfg.lr_decrease_factor_explosion, what)
        rec.tighten_clip(plan, what, resend=True)

    def _slow(self, plan: ActionPlan, d: Decision, inc: Incident, what: str) -> None:
        cfg, rec = self.config, self.recovery
        if inc.divergence_lr_steps == 0:
            plan.add(CheckpointParams(reason="emergency"), f"{what}: emergency checkpoint")
            self._remember_level(d)
            rec.lower_lr(plan, cfg.lr_step_factor_divergence, f"{what}: LR step 1")
        elif (
            self.observed_steps - (inc.last_divergence_tick or 0)
            < cfg.divergence_step_interval_steps
        ):
            return
        elif inc.divergence_lr_steps >= cfg.divergence_max_lr_steps or not rec.lower_lr(
            plan, cfg.lr_step_factor_divergence, f"{what}: LR step {inc.divergence_lr_steps + 1}"
        ):
            if not self._damaged():
                # A rollback needs evidence that the weights are damaged; a rise still said
                # with the loss near its level is said once and left to the lowered LR.
                self._watch(
                    plan,
                    inc,
                    f"{what} continues after {inc.divergence_lr_steps} LR steps, but the loss is "
                    f"not damaged ({self._damage_said()}): no rollback",
                )
                return
            self._recover(
                plan,
                d,
                inc,
                cfg.lr_step_factor_divergence,
                False,
                f"{what} continues after {inc.divergence_lr_steps} LR steps",
            )
            return
        inc.divergence_lr_steps += 1
        inc.last_divergence_tick = self.observed_steps

    # --- damage: a loss far above its level before the incident ------------------------------
    def _remember_loss(self, d: Decision) -> None:
        self.recent_losses += _finite_loss(d)
        del self.recent_losses[: max(0, len(self.recent_losses) - self.config.damage_window_steps)]
        if not d.is_anomaly:
            self.healthy_losses += _finite_loss(d)
            kept = HEALTHY_KEPT_BLOCKS * max(DAMAGE_LOOKS) * self.config.bad_stretch_steps
            del self.healthy_losses[: max(0, len(self.healthy_losses) - kept)]

    def _remember_level(self, d: Decision) -> None:
        """The loss level before the LR is lowered (kept from the first incident until restored):
        fusion's baseline, learnt from healthy steps only, so still the level before the rise."""
        e = d.evidence
        if self.level_before is None and e is not None and e.loss_baseline is not None:
            self.level_before = e.loss_baseline

    def _damage_said(self) -> str:
        """The damage test's numbers, for an alert."""
        level, recent = self.level_before, self.recent_losses
        if level is None or len(recent) < self.config.damage_window_steps:
            return f"fewer than {self.config.damage_window_steps} losses to judge it on"
        median = sorted(recent)[len(recent) // 2]
        return (
            f"median {median:.4g} over the last {len(recent)} steps, level {level:.4g} before "
            f"the rise, damaged above x{self.config.damage_loss_ratio:g}"
        )

    def _damaged(self) -> bool:
        """The recent losses' median far above the level before the LR was lowered (a full window
        of them: a few steps prove nothing)."""
        level, recent = self.level_before, self.recent_losses
        if level is None or len(recent) < self.config.damage_window_steps:
            return False
        median = sorted(recent)[len(recent) // 2]
        return median > level + (self.config.damage_loss_ratio - 1) * abs(level)

    def _watch_lr_damage(self, d: Decision, inc: Incident) -> None:
        self._remember_level(d)
        self.lr_damage = {
            "incident": inc.key,
            "since": self.observed_steps,
            "claim": {"step": d.step, "epoch": d.epoch, "type": d.type.value},
            "evidence": json.loads(d.evidence.model_dump_json()) if d.evidence else None,
        }

    def _judge_lr_damage(self, plan: ActionPlan, d: Decision) -> bool:
        """An LR-induced incident's answer a window old: a loss still far above its level
        before the jump is damage a held or lower LR cannot undo (a model collapsed to chance
        learns nothing back): roll back to before the jump, at the checkpoint's LR, without
        skipping the (good) data; the re-run holds the jump (HOLD_LR). True if it did."""
        w, cfg = self.lr_damage, self.config
        if w is None or self.observed_steps - w["since"] < cfg.damage_window_steps:
            return False
        if not self._damaged():
            held = self.lr_hold_until is not None and self.observed_steps < self.lr_hold_until
            if not held:
                self.lr_damage = None  # the rise is over and the loss back: absorbed
            return False
        self.lr_damage = None
        inc = self.incidents.incidents.get(w["incident"]) or self.incidents.get(
            d, self.observed_steps
        )
        plan.incident_id, plan.incident_onset_step = inc.key, inc.onset_step
        plan.claim = Claim.model_validate(w["claim"])  # the claim the trainer backed
        plan.evidence = Evidence.model_validate(w["evidence"]) if w["evidence"] else None
        plan.response = Response.LR_INDUCED
        self.lr_jump_harmful = True
        self.lr_hold_until = None
        median = sorted(self.recent_losses)[len(self.recent_losses) // 2]
        self._recover(
            plan,
            d,
            inc,
            None,
            False,
            f"loss median {median:.4g} over the last {cfg.damage_window_steps} steps, "
            f"{median / self.level_before if self.level_before else math.inf:.3g}x its level "
            f"{self.level_before:.4g} before the learning rate jumped: the model was damaged",
            confirmed=False,
            skip_data=False,
            hold_lr=True,
        )
        return True

    def _judge_spike(self, plan: ActionPlan, d: Decision) -> bool:
        """Judge a pending spike once its patience ran out; True if nothing more is to be done."""
        p = self.pending_spike
        if p is None or d.step < p.judge_at:
            return False
        self.pending_spike = None
        cfg = self.config
        steps = d.step - p.start
        if d.is_anomaly and d.type is AnomalyType.NON_FINITE:
            return False  # the non-finite rule answers it
        unabsorbed = p.critical and not d.is_anomaly and not self._absorbed(p, d)
        if unabsorbed or (
            d.is_anomaly and not d.preventive and d.type is not AnomalyType.OUTLIER_STEP
        ):
            inc = self.incidents.incidents.get(p.incident) or self.incidents.get(
                d, self.observed_steps
            )
            plan.incident_id = inc.key  # the judging step may be a healthy one: name the spike's
            plan.incident_onset_step = inc.onset_step
            if p.claim is not None:  # ... and claim the spike's step, as the trainer saw it
                plan.claim = Claim.model_validate(p.claim)
                plan.evidence = Evidence.model_validate(p.evidence) if p.evidence else None
            self.healthy_streak = 0
            critical = p.critical or d.critical
            still = (
                f"{'extreme loss' if p.critical else 'loss spike'} at step {p.start} "
                f"still anomalous {steps} steps later ({d.type.value} at step {d.step})"
            )
            if unabsorbed:
                still = (
                    f"extreme loss at step {p.start} not absorbed: its update was applied "
                    f"with a gradient norm not within x{self.config.absorbed_grad_ratio:g} of "
                    f"the baseline, or the loss is not back at the baseline {steps} steps later"
                )
            if inc.lr_induced:
                # The data is fine: back to before the jump, without skipping it, at the LR the
                # checkpoint had. If the jump is in the schedule it comes again on the re-run,
                # and is scaled back at once (it caused a rise once).
                plan.response = Response.LR_INDUCED
                self.lr_jump_harmful = True
                self.lr_hold_until = None
                self._recover(
                    plan,
                    d,
                    inc,
                    None,
                    False,  # no clipping: the re-run holds the jump itself (HOLD_LR)
                    f"{still}, after an LR jump",
                    confirmed=critical,
                    skip_data=False,
                    hold_lr=True,
                )
            elif (
                cfg.flat_rise_waits
                and not critical
                and not p.unbounded
                and not self._unbounded(d)
                and (d.type in cfg.spike_types or self._within_wander(d))
            ):
                self._watch_flat_rise(plan, d, inc, still, p)
            else:
                # Every update of the incident left the weights bounded (the Guard skipped it, or
                # its gradient stayed within absorbed_grad_ratio of the baseline): the loss is the
                # data's, not the optimizer's. Rolling back and skipping its batches removes the
                # cause; an LR cut and clipping would only slow the rest of the run (a CNN's five
                # shuffled-label batches left it at half its LR for 700 steps, clipped to the end).
                bounded = p.harmless and (not d.is_anomaly or self._harmless(d))
                if critical and bounded and self._data_level(plan, d, inc, still):
                    return True  # met again on other data: no second rollback, no stop
                if critical and bounded:
                    still = f"{still}; every update of it bounded: the data's, LR and clipping kept"
                unstable = critical and not bounded
                plan.response = Response.CRITICAL if unstable else Response.DATA_SPIKE
                factor = (
                    cfg.lr_decrease_factor_critical if unstable else cfg.lr_decrease_factor_spike
                )
                self._recover(plan, d, inc, factor, unstable, still, confirmed=critical)
            return True
        why = (
            f"{'extreme loss' if p.critical else 'loss spike'} at step {p.start} "
            f"absorbed within {steps} steps (back to normal: no rollback)"
        )
        absorbed = self.incidents.incidents.get(p.incident)
        if absorbed is not None:
            # The alert names the incident it closes: the Guard keeps its record (the batches'
            # sample ids) for `spikeguard inspect`, though nothing was rolled back.
            plan.incident_id, plan.incident_onset_step = absorbed.key, absorbed.onset_step
        plan.response = Response.ABSORBED
        plan.add(CheckpointParams(reason="on_demand"), f"{why}: checkpoint the recovered state")
        plan.alert("info", f"{why}; watching", f"{why}: watch only")
        plan.response = None
        return False

    def _preventive(self, plan: ActionPlan, d: Decision) -> None:
        cfg = self.config
        self.healthy_streak = 0
        last = self.last_preventive_tick
        if last is not None and self.observed_steps - last < cfg.preventive_min_interval_steps:
            return
        self.last_preventive_tick = self.observed_steps
        plan.response = Response.PREVENTIVE
        what = f"warning {d.type.value} at step {d.step}"
        plan.add(
            CheckpointParams(reason="on_demand"),
            f"{what}: checkpoint now (the trainer decides whether it is healthy)",
        )
        if d.type is AnomalyType.STALLED:
            plan.alert("info", f"{what}: training looks stalled", what)
        elif cfg.preventive_clip:
            floor = cfg.clip_norm_initial * cfg.clip_tighten_factor  # one notch at most
            self.recovery.tighten_clip(plan, what, floor=floor)

    def _healthy(self, plan: ActionPlan, d: Decision) -> None:
        lr = self.recovery.lr
        if lr.current >= lr.ceiling * (1 - 1e-9) and self.lr_damage is None:
            # nothing lowered (or all restored), no held jump being judged: nothing to protect
            self.level_before = None
        if self._damaged():
            self.healthy_streak = 0  # a plateau far above the level before is damage, not health
            return
        self.healthy_streak += 1
        if self._cause_removed(plan, d):
            return
        if self.lr_hold_until is not None and self.observed_steps < self.lr_hold_until:
            return  # an LR jump was scaled back: it may still be in the schedule
        if self.healthy_streak >= self.config.lr_restore_healthy_steps:
            why = f"{self.healthy_streak} healthy steps up to step {d.step}"
            plan.response = Response.RESTORE
            if self.recovery.restore_lr(plan, why):
                self.healthy_streak = 0

    def _cause_removed(self, plan: ActionPlan, d: Decision) -> bool:
        """The re-run after a rollback that skipped an incident's data has trained on the batches
        after the skipped ones, every step of them healthy: the cause is gone. What the recovery
        changed comes back at once, to the checkpoint's: the LR it cut (one restore step per 200
        healthy steps left a CNN at half its LR for 800 steps after five bad batches) and the
        clipping it set (kept to the run's end, it bounded every later update). True if it gave
        anything back."""
        window = self.rerun_window
        if window is None or d.step < window.end - 1:
            return False
        self.rerun_window = None  # a later rise is not on the batches after the skipped ones
        if self.rerun_troubled:
            return False  # trouble on the re-run: the cut and the clip were not only the data's
        plan.response = Response.CAUSE_REMOVED
        why = (
            f"steps {window.start}..{window.end - 1} of the re-run trained on the batches after "
            "the skipped ones, every one healthy: the data that caused the incident is gone"
        )
        lr = self.recovery.lr
        before = lr.at(window.checkpoint_step)
        restored = before > lr.current * (1 + 1e-9) and self.recovery.restore_lr(
            plan, f"{why}, the LR its recovery cut given back", before / lr.current
        )
        lifted = window.clip_given and self.recovery.lift_clip(
            plan, f"{why}, the clipping its recovery set lifted", window.clip_before
        )
        plan.response = None
        if not (restored or lifted):
            return False
        self.healthy_streak = 0
        return True

    def _recover(
        self,
        plan: ActionPlan,
        d: Decision,
        inc: Incident,
        lr_factor: float | None,
        tighten: bool,
        why: str,
        *,
        confirmed: bool | None = None,
        skip_data: bool = True,
        hold_lr: bool = False,
        skip_to: int | None = None,
        widening: bool = False,
    ) -> None:
        """Roll back (or fall back) — unless that would be one recovery too many.

        Past the budget a critical decision stops the run; anything less is said once and
        watched: a chain of low-confidence incidents never stops a run. ``confirmed`` (default:
        the decision is critical) allows the LR-and-skip-ahead fallback when no checkpoint is
        eligible; an unconfirmed incident without one is watched instead. ``widening``: the
        incident's own skipped window was too short for its bad data (_bad_stretch): this
        finishes its recovery rather than being one more, so the per-incident limit does not
        count it (it comes at most once per rise).
        """
        self.pending_spike = None
        self.healthy_streak = 0
        confirmed = d.critical if confirmed is None else confirmed
        too_many = (
            None if widening else self.recovery.ledger.escalation_reason(inc, self.observed_steps)
        )
        at = self.recovered_at.get(inc.key, [])
        if too_many is not None and (at is None or (at and [self.epoch, d.step] < at)):
            return  # the trainer ran this step before the last recovery took effect: not its failure
        if too_many is not None and confirmed:
            plan.response = Response.STOP
            add_escalation(plan, too_many)
            self.stopped = True
            return
        if too_many is not None:
            self._watch(
                plan,
                inc,
                f"{why}; not recovering again: {too_many}, and the evidence is not critical",
            )
            return
        issued = len(plan.items)
        if not self.recovery.recover(
            plan,
            d,
            inc,
            self.observed_steps,
            lr_factor,
            tighten,
            why,
            fall_back=confirmed,
            skip_data=skip_data,
            hold_lr=hold_lr,
            skip_to=skip_to,
        ):
            self._watch(
                plan,
                inc,
                f"{why}; {self.recovery.missing_target(inc, d)}, and the "
                "incident is not confirmed (not critical): no fallback",
            )
            return
        self.lr_damage = None  # the recovery answers the damage too
        for ordinal, (params, _) in enumerate(plan.items[issued:], issued):
            self.recovery_actions[action_id(plan.source, params.kind.value, ordinal)] = inc.key
        self.recovered_at[inc.key] = None
        for book in (self.recovery_actions, self.recovered_at):
            while len(book) > MAX_ACK_RECORDS:
                book.popitem(last=False)

    def _watch(self, plan: ActionPlan, inc: Incident, why: str) -> None:
        if inc.watched:
            return
        inc.watched = True
        plan.response = Response.WATCH
        plan.alert("warning", f"{why}; watching")

    # --- state ----------------------------------------------------------------------------------
    def _check_run(self, run_id: str) -> None:
        if run_id != self.run_id:
            raise ForeignRunError(f"event for run {run_id!r} reached the policy of {self.run_id!r}")

    def state_dict(self, *, keep_seen: bool = False) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "epoch": self.epoch,
            "high_water": self.high_water,
            "observed_steps": self.observed_steps,
            "seen": self.seen.copy() if keep_seen else self.seen.state_dict(),
            "tail": self.tail,
            "pending_spike": None
            if self.pending_spike is None
            else self.pending_spike.state_dict(),
            "healthy_streak": self.healthy_streak,
            "last_preventive_tick": self.last_preventive_tick,
            "last_non_finite_tick": self.last_non_finite_tick,
            "lr_jump_tick": self.lr_jump_tick,
            "lr_hold_until": self.lr_hold_until,
            "lr_jump_harmful": self.lr_jump_harmful,
            "explosions": self.explosions,
            "level_before": self.level_before,
            "recent_losses": list(self.recent_losses),
            "healthy_losses": list(self.healthy_losses),
            "lr_damage": self.lr_damage,
            "rerun_window": None if self.rerun_window is None else list(self.rerun_window),
            "rerun_troubled": self.rerun_troubled,
            "data_level_until": self.data_level_until,
            "stretch": self.stretch,
            "stopped": self.stopped,
            "acks": [[k, v] for k, v in self.acks.items()],
            "recovery_actions": [[k, v] for k, v in self.recovery_actions.items()],
            "recovered_at": [[k, v] for k, v in self.recovered_at.items()],
            "counts": dict(self.counts),
            "lr_sent": [[k, v] for k, v in self.lr_sent.items()],
            "recovery": self.recovery.state_dict(),
            "incidents": self.incidents.state_dict(),
        }

    def undo_state(self) -> dict[str, Any]:  # Stage.undo_point, per batch: the window as arrays
        return self.state_dict(keep_seen=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["run_id"] != self.run_id:
            raise ForeignRunError(
                f"state of {state['run_id']!r} loaded into the policy of {self.run_id!r}"
            )
        self.epoch, self.high_water = state["epoch"], state["high_water"]
        # "tick": the name in snapshots written before the rename.
        self.observed_steps = (
            state["observed_steps"] if "observed_steps" in state else state["tick"]
        )
        self.seen.load_state_dict(state["seen"])
        self.tail = state["tail"]
        pending = state["pending_spike"]
        self.pending_spike = None if pending is None else PendingSpike.from_state(pending)
        self.healthy_streak, self.stopped = state["healthy_streak"], state["stopped"]
        self.last_preventive_tick = state["last_preventive_tick"]
        # Snapshots written before cause-aware responses lack these: nothing seen yet.
        self.last_non_finite_tick = state.get("last_non_finite_tick")
        self.lr_jump_tick = state.get("lr_jump_tick")
        self.lr_hold_until = state.get("lr_hold_until")
        self.lr_jump_harmful = bool(state.get("lr_jump_harmful", False))
        self.explosions = int(state.get("explosions", 0))
        # Snapshots written before damage was judged lack these: no level known yet.
        self.level_before = state.get("level_before")
        self.recent_losses = [float(x) for x in state.get("recent_losses", [])]
        self.healthy_losses = [float(x) for x in state.get("healthy_losses", [])]
        self.lr_damage = state.get("lr_damage")
        window = state.get("rerun_window")
        self.rerun_window = None if window is None else RerunWindow(*window)
        self.rerun_troubled = bool(state.get("rerun_troubled", False))
        self.data_level_until = state.get("data_level_until")
        self.stretch = state.get("stretch")
        self.acks = OrderedDict((k, v) for k, v in state["acks"])
        self.recovery_actions = OrderedDict((k, v) for k, v in state.get("recovery_actions", []))
        self.recovered_at = OrderedDict((k, v) for k, v in state.get("recovered_at", []))
        self.counts = dict(state["counts"])
        self.lr_sent = OrderedDict((k, float(v)) for k, v in state.get("lr_sent", []))
        self.recovery.load_state_dict(state["recovery"])
        self.incidents.load_state_dict(state["incidents"])
