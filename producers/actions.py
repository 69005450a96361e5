"""Actions in the trainer: refuse, deduplicate, schedule, apply, answer.

Every action gets exactly one Ack: REJECTED (bad/missing signature when a key
is set; evidence that does not match what this trainer published, or a
decision's claim that the trainer's own view of the step does not back, see
evidence.py; or, when a key is set, a state-changing action — anything but
an ALERT, or any action naming a decision — with no evidence at all),
DUPLICATE (its id was applied before — across rollbacks and restarts, see
ledger.py), UNHANDLED (nobody can apply it: REDUCE_BATCH_SIZE or SET_EPS
without a registered handler), FAILED (bad parameters, no checkpoint to roll
back to, a handler raised; or the rollback of the same decision failed or was
refused: a decision's actions apply whole or not at all) or APPLIED with what
was done. An action is due at its ``apply_at_step``; one that arrives later is
applied at the next step and its ack says it was late. Actions that follow a
ROLLBACK of the same decision are due at once (the rollback moved the step
counter back).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from spikeguard.schemas.signing import Signer
from spikeguard.errors import SpikeguardError
from spikeguard.producers.clipping import GradClipper
from spikeguard.producers.evidence import PublishedSteps
from spikeguard.producers.lr import LRControl
from spikeguard.schemas import AckStatus, Action, ActionKind, Evidence, StepEvent
from spikeguard.schemas.actions import (
    AlertParams,
    CheckpointParams,
    ClipParams,
    HoldLrParams,
    RestoreLrParams,
    RollbackParams,
    ScaleLrParams,
    SetEpsParams,
    SetLrParams,
    SkipBatchesParams,
    StopParams,
)

log = logging.getLogger(__name__)

#: A user's handler for an action kind: ``handler(action, guard) -> result text``.
Handler = Callable[[Action, "Steerable"], "str | None"]

# Kinds that mean "the run is in trouble": checkpoints after them are unhealthy
# until a healthy stretch has passed.
ANOMALY_KINDS = frozenset(
    {
        ActionKind.ROLLBACK,
        ActionKind.SKIP_BATCHES,
        ActionKind.SCALE_LR,
        ActionKind.SET_LR,
        ActionKind.HOLD_LR,
        ActionKind.CLIP,
        ActionKind.STOP,
        ActionKind.REDUCE_BATCH_SIZE,
        ActionKind.SET_EPS,
    }
)
# The kinds a decision's claim must be backed for (evidence.py): all that change the run,
# except RESTORE_LR (it moves the LR back towards the user's own setting, after healthy steps)
# and a CLIP that lifts (it gives clipping back the same way): see gives_back.
NEEDS_AGREEMENT = ANOMALY_KINDS
MAX_BROKEN_PLANS = 1024  # decisions remembered whose rollback failed (oldest forgotten first)
MAX_AGREED_INCIDENTS = 1024  # incidents the trainer agreed were real (oldest forgotten first)
# (QK_CLIP: the trainer's mechanism signals apply it, producers/signals/prevention.py, rescaling
# only heads they measured over its threshold themselves.)
HANDLER_ONLY = frozenset({ActionKind.REDUCE_BATCH_SIZE, ActionKind.SET_EPS, ActionKind.QK_CLIP})
# The one kind that changes nothing in the run (it is logged): it needs no evidence
# unless it answers a decision (then it was derived from steps, and says which).
EVIDENCE_EXEMPT = frozenset({ActionKind.ALERT})


def gives_back(action: Action) -> bool:
    """Whether ``action`` gives back a setting a recovery changed (a CLIP that lifts): decided on
    healthy steps, it neither marks the run in trouble nor needs the trainer's agreement that the
    decided step was anomalous, as RESTORE_LR needs none."""
    return isinstance(action.params, ClipParams) and action.params.lifts


def marks_trouble(action: Action) -> bool:
    """One of ANOMALY_KINDS, and not one that gives a setting back."""
    return action.kind in ANOMALY_KINDS and not gives_back(action)


class ActionFailed(SpikeguardError):
    """An action could not be applied; the message goes into the FAILED ack."""


@dataclass
class Outcome:
    action: Action
    status: AckStatus
    step: int
    result: str = ""


def operator_evidence(published: StepEvent) -> Evidence:
    """The evidence for an operator's own action: a step the run's trainer published itself.

    With a signing key the Guard refuses a state-changing action that names no
    step it published (:meth:`ActionQueue.receive`). An operator (``spikeguard
    stop``) reads the run's newest StepEvent from the steps topic and copies its
    values here; the trainer remembers its last 4096 steps.
    """
    return Evidence(
        step=published.step,
        epoch=published.epoch,
        loss=published.loss,
        grad_norm=None if published.skip_reason == "scaler_overflow" else published.grad_norm,
    )


class ActionQueue:
    """Pending actions of one run, in arrival order, filtered and deduplicated."""

    def __init__(
        self, ledger: Any, signer: Signer | None = None, published: PublishedSteps | None = None
    ) -> None:
        self.ledger = ledger
        self.signer = signer if signer is not None else Signer()
        self.published = published if published is not None else PublishedSteps()
        self.pending: list[Action] = []
        self.urgent_decisions: set[str] = set()  # decisions whose rollback was applied
        # Decisions whose rollback failed or was refused -> why: a plan applies whole or not at
        # all, so its skip window, LR and clipping must not run without the rollback.
        self.broken_plans: OrderedDict[str, str] = OrderedDict()
        # Incidents whose claim this trainer backed once. A persistent incident (weights corrupted
        # by bad data) keeps the pipeline's loss high while the local outlier model re-levels onto
        # it, so a later step of the same incident (where the policy escalates: a further recovery
        # or a stop) need not look anomalous here; the incident does not have to be agreed again.
        self.agreed_incidents: OrderedDict[str, None] = OrderedDict()

    def plan_failed(self, action: Action, outcome: Outcome) -> None:
        """``action`` was not applied: if it is its decision's rollback, the rest of the plan is off."""
        if action.kind is not ActionKind.ROLLBACK or action.decision_id is None:
            return
        self.broken_plans[action.decision_id] = (
            f"not applied: the rollback {action.action_id} of the same decision was "
            f"{outcome.status.value} ({outcome.result}); a decision's actions apply whole or not at all"
        )
        while len(self.broken_plans) > MAX_BROKEN_PLANS:
            self.broken_plans.popitem(last=False)

    def broken_plan(self, action: Action) -> str | None:
        """Why ``action`` must not apply because its plan's rollback did not (None: it may).
        An ALERT still does: it changes nothing, and says what happened."""
        if action.decision_id is None or action.kind is ActionKind.ALERT:
            return None
        return self.broken_plans.get(action.decision_id)

    def receive(self, action: Action, step: int) -> Outcome | None:
        """Queue ``action``, or the outcome to ack right away (refused or duplicate)."""
        if not self.signer.verifies(action):
            why = "unsigned" if not action.signature else "bad signature"
            log.warning(
                "spikeguard: refused %s action %s for run %s: %s",
                action.kind.value,
                action.action_id,
                action.run_id,
                why,
            )
            return Outcome(action, AckStatus.REJECTED, step, f"{why}; action refused")
        # (only after the signature: a forged rollback must not call off a genuine plan)
        outcome = self._screen(action, step)
        if outcome is not None and outcome.status is AckStatus.REJECTED:
            self.plan_failed(action, outcome)
        return outcome

    def _screen(self, action: Action, step: int) -> Outcome | None:
        # The signature says the run's pipeline made the action, not that the run's own
        # steps called for it: the actuator signs whatever its policy derives from the
        # decisions topic, and anyone who can write there could forge a decision. So with
        # a key, a state-changing action must name a step this trainer published, with the
        # values it published (an operator's action copies them from the steps topic; see
        # operator_evidence). Without a key there is nothing to vouch for the evidence itself.
        if action.evidence is None:
            if self.signer.enabled and (
                action.kind not in EVIDENCE_EXEMPT or action.decision_id is not None
            ):
                why = (
                    f"{action.kind.value} action carries no evidence (the step, loss and gradient "
                    "norm it was decided on); a state-changing action, and any action derived "
                    "from a decision, must; action refused"
                )
                log.warning(
                    "spikeguard: refused %s action %s for run %s: no evidence",
                    action.kind.value,
                    action.action_id,
                    action.run_id,
                )
                return Outcome(action, AckStatus.REJECTED, step, why)
        else:
            problem = self.published.problem(action.evidence)
            if problem is not None:
                log.warning(
                    "spikeguard: refused %s action %s for run %s: %s",
                    action.kind.value,
                    action.action_id,
                    action.run_id,
                    problem,
                )
                return Outcome(action, AckStatus.REJECTED, step, f"{problem}; action refused")
        # Published is not the same as anomalous: a decision's claim must be of the evidence's own
        # step, and this trainer's own statistics must agree the step was what the decision says.
        if action.claim is not None and action.kind in NEEDS_AGREEMENT and not gives_back(action):
            agreed = action.incident_id is not None and action.incident_id in self.agreed_incidents
            problem = self.published.claim_problem(action.claim, action.evidence, agreed=agreed)
            if problem is None and action.incident_id is not None:
                self.agreed_incidents[action.incident_id] = None
                self.agreed_incidents.move_to_end(action.incident_id)
                while len(self.agreed_incidents) > MAX_AGREED_INCIDENTS:
                    self.agreed_incidents.popitem(last=False)
            if problem is not None:
                log.warning(
                    "spikeguard: refused %s action %s for run %s: %s",
                    action.kind.value,
                    action.action_id,
                    action.run_id,
                    problem,
                )
                return Outcome(action, AckStatus.REJECTED, step, f"{problem}; action refused")
        if action.action_id in self.ledger:
            return Outcome(action, AckStatus.DUPLICATE, step, "already applied")
        if any(p.action_id == action.action_id for p in self.pending):
            return Outcome(action, AckStatus.DUPLICATE, step, "already pending")
        self.pending.append(action)
        return None

    def due(self, step: int) -> list[Action]:
        """Remove and return the actions to apply at ``step`` (stable, by apply_at_step)."""
        ready = [
            a
            for a in self.pending
            if a.apply_at_step <= step or (a.decision_id in self.urgent_decisions)
        ]
        if ready:
            ids = {a.action_id for a in ready}
            self.pending = [a for a in self.pending if a.action_id not in ids]
        return sorted(ready, key=lambda a: a.apply_at_step)


class Steerable(Protocol):
    """What applying an action needs of the trainer's side (the Guard is one)."""

    handlers: dict[ActionKind, Handler]
    actions: ActionQueue
    lr: LRControl
    clipper: GradClipper
    optimizer: Any  # a torch optimizer, or a framework's wrapper with its param_groups

    def rollback(
        self, target_step: int, checkpoint_id: str | None = None, onset_step: int | None = None
    ) -> str: ...

    def skip_steps(
        self, from_step: int, to_step: int, extra: int = 0, after_rollback: bool = False
    ) -> str: ...

    def request_checkpoint(self, action: Action, reason: str) -> None: ...

    def request_stop(self, reason: str) -> None: ...

    def say_alert(self, step: int, severity: str, message: str) -> None: ...


def apply_action(guard: Steerable, action: Action, step: int) -> Outcome | None:
    """Apply one due action; None when the ack comes later (a checkpoint taken at step end)."""
    late = (
        f"late (due at step {action.apply_at_step}); "
        if action.apply_at_step < step and action.decision_id not in guard.actions.urgent_decisions
        else ""
    )
    handler = guard.handlers.get(action.kind)
    try:
        if action.kind in HANDLER_ONLY:
            if handler is None:
                return Outcome(
                    action,
                    AckStatus.UNHANDLED,
                    step,
                    f"no handler registered for {action.kind.value}",
                )
            action.params.check()  # a user handler gets values the schema allows
            result = handler(action, guard) or "handled"
            return Outcome(action, AckStatus.APPLIED, step, late + str(result))
        done = _builtin(guard, action, step)
        if handler is not None:
            extra = handler(action, guard)
            if done is not None and extra:  # (None: acked later, once; the handler ran here)
                done = f"{done}; handler: {extra}"
    except (ActionFailed, ValueError, KeyError, TypeError) as exc:
        return Outcome(action, AckStatus.FAILED, step, late + f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        log.exception("spikeguard: applying %s failed", action.kind.value)
        return Outcome(action, AckStatus.FAILED, step, late + f"{type(exc).__name__}: {exc}")
    if done is None:
        return None
    return Outcome(action, AckStatus.APPLIED, step, late + done)


def _builtin(guard: Steerable, action: Action, step: int) -> str | None:
    # The parameters' types were checked when the action was parsed; their values
    # are checked here, so a bad one is answered with a FAILED ack that names it.
    p, kind = action.params, action.kind
    try:
        p.check()
    except ValueError as exc:
        raise ActionFailed(str(exc)) from None
    if isinstance(p, RollbackParams):
        result = guard.rollback(p.target_step, p.checkpoint_id, action.incident_onset_step)
        if action.decision_id:
            guard.actions.urgent_decisions.add(action.decision_id)
        return result
    if isinstance(p, SkipBatchesParams):
        return guard.skip_steps(
            p.from_step,
            p.to_step,
            p.extra,
            after_rollback=action.decision_id in guard.actions.urgent_decisions,
        )
    if isinstance(p, ScaleLrParams):
        return f"lr scaled by {p.factor:g} -> {guard.lr.scale_by(p.factor):.3g}"
    if isinstance(p, SetLrParams):
        return f"lr set to {guard.lr.set(p.lr):.3g}"
    if isinstance(p, RestoreLrParams):
        return f"lr restored towards base -> {guard.lr.restore(p.factor):.3g}"
    if isinstance(p, HoldLrParams):
        return guard.lr.hold()
    if isinstance(p, ClipParams):
        if p.lifts:
            return f"recovery clipping lifted: {guard.clipper.lift(p.max_norm)}"
        if p.mode == "adaptive" and p.z is not None:  # (check() above: the mode's value is there)
            return f"adaptive clipping at z={guard.clipper.set_adaptive(p.z):g}"
        if p.max_norm is not None:
            return f"clipping at max_norm={guard.clipper.set_fixed(p.max_norm):g}"
    if isinstance(p, CheckpointParams):
        guard.request_checkpoint(action, p.reason)
        return None
    if isinstance(p, StopParams):
        guard.request_stop(p.reason or action.reason or "stop action")
        return "stopping"
    if isinstance(p, AlertParams):
        guard.say_alert(step, p.severity, p.message or action.reason or "")
        return "alert logged"
    raise ActionFailed(f"no built-in handling for {kind.value}")  # pragma: no cover


def set_optimizer_eps(action: Action, guard: Steerable) -> str:
    """A ready-made SET_EPS handler for optimizers with an ``eps`` (Adam, AdamW, ...).

    Register it with ``guard.on(ActionKind.SET_EPS, set_optimizer_eps)``.
    """
    params = action.params
    if not isinstance(params, SetEpsParams):
        raise ActionFailed(f"set_optimizer_eps handles set_eps actions, not {action.kind.value}")
    try:
        params.check()
    except ValueError as exc:
        raise ActionFailed(str(exc)) from None
    eps = params.eps
    groups = [g for g in guard.optimizer.param_groups if "eps" in g]
    if not groups:
        raise ActionFailed("the optimizer has no eps")
    for g in groups:
        g["eps"] = eps
    return f"eps set to {eps:g} on {len(groups)} param group(s)"
