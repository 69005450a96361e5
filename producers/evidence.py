"""The trainer trusts its own numbers: an action is checked against what the trainer itself saw.

A signature says an action came from the run's actuator, not that the run
called for it: the actuator signs whatever its policy derives from the
decisions topic, and a forged decision (evidence copied from the steps topic)
would otherwise buy a rollback, a skip window or a lower LR on a healthy run.
So the trainer keeps, for its newest steps, what it published and what it
judged locally (:class:`StepView`), and checks every action against it:

- its **evidence** must be values this trainer published, for that step and
  epoch (:meth:`PublishedSteps.problem`);
- an action derived from a decision carries the decision's **claim** (step,
  epoch, anomaly type). Its evidence must be of that very step and epoch, and
  the trainer's own view of the step must agree it was anomalous for that
  type (:func:`disagreement`): a non-finite claim needs a non-finite loss or
  gradient seen here (a GradScaler's overflow is normal); a loss-scale
  collapse needs an overflow or a non-finite value; an LR-induced rise or an LR out of
  bounds needs the trainer's own LR to have jumped beyond any rate it had trained at (within the
  outlier model's ``lr_grace``), or what the other types need; an attention-logit growth needs
  the trainer's own mechanism signals over their agreement bar (producers/signals/prevention.py),
  or what the other types need; any other anomaly
  type needs a non-finite value, or the local outlier model (skip_rule.py) scoring the
  loss or gradient norm at least :data:`AGREE_Z` of the way to its skip
  threshold above its level (a lower bar than skipping: agreeing that a step was unusual is
  not acting on it alone). The claim is checked for the kinds that change the
  run (``actions.NEEDS_AGREEMENT``); an ALERT, a CHECKPOINT and a RESTORE_LR
  (back towards the user's own LR) are not. Once the trainer has backed an incident's
  claim, the incident's later actions need not be backed again (its later steps may look
  normal to a local model that re-levelled onto a persistent fault); their steps must still
  be ones it published.

An action without a claim is a key holder's own command (``spikeguard
stop``; see :func:`spikeguard.producers.actions.operator_evidence`): it is
checked against its evidence only, and the signature vouches for the rest.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, NamedTuple

from spikeguard.producers.skip_rule import SkipDecision
from spikeguard.schemas import AnomalyType, Claim, Evidence

#: How far towards its skip threshold (1.0: at it; outlier_model.Judged.score) a step's loss
#: or gradient norm must rise above its level for the trainer to agree that it was anomalous:
#: agreeing that a step was unusual is a lower bar than skipping it on that alone.
AGREE_Z = 0.5

# Claims that only a non-finite value (or, under a GradScaler, the scaler's overflow) can back.
_NON_FINITE_TYPES = frozenset({AnomalyType.NON_FINITE})
_OVERFLOW_TYPES = frozenset({AnomalyType.LOSS_SCALE_COLLAPSE})
# Claims the trainer's own LR jumping beyond any rate it had trained at backs.
_LR_TYPES = frozenset({AnomalyType.LR_INDUCED_RISE, AnomalyType.LR_OUT_OF_BOUNDS})
# Claims the trainer's own mechanism signals back (producers/signals/prevention.py).
_SIGNAL_TYPES = frozenset({AnomalyType.ATTENTION_LOGIT_GROWTH})


class StepView(NamedTuple):
    """What the trainer itself published and saw at one step."""

    loss: float
    grad_norm: float | None
    #: a non-finite loss or gradient (not a GradScaler's overflow: that is the scaler's business)
    non_finite: bool = False
    scaler_overflow: bool = False
    #: the local outlier model's robust z of the loss / gradient norm (None: not above its
    #: baseline, not scored, or too little history yet)
    loss_z: float | None = None
    grad_z: float | None = None
    #: the local outlier model saw this step's LR (or a recent one) jump beyond any the run had
    #: trained at
    lr_beyond_peak: bool = False
    #: the trainer's own mechanism signals were over their agreement bar at this step
    signal_over: bool = False

    def describe(self) -> str:
        def z(value: float | None) -> str:
            return "not above its baseline" if value is None else f"z {value:.2f}"

        return (
            f"loss {self.loss!r} ({z(self.loss_z)}), grad_norm {self.grad_norm!r} "
            f"({z(self.grad_z)}), {'non-finite' if self.non_finite else 'finite'}"
            f"{', scaler overflow' if self.scaler_overflow else ''}"
            f"{', after an LR jump beyond its peak' if self.lr_beyond_peak else ''}"
            f"{', its mechanism signals over their bar' if self.signal_over else ''}"
        )


def own_view(
    non_finite: bool,
    scaler_overflow: bool,
    scored: SkipDecision | None = None,
    signal_over: bool = False,
    loss: float = math.nan,
    grad_norm: float | None = None,
) -> StepView:
    """A step's local judgement; ``scored``: the outlier model's SkipDecision (None: not scored).

    ``loss`` and ``grad_norm``: the values published (else filled in by
    :meth:`PublishedSteps.remember`).
    """
    if scored is None:
        return StepView(loss, grad_norm, non_finite, scaler_overflow, signal_over=signal_over)
    return StepView(
        loss,
        grad_norm,
        non_finite,
        scaler_overflow,
        scored.loss_z,
        scored.grad_z,
        scored.lr_beyond_peak,
        signal_over,
    )


def disagreement(claim: Claim, view: StepView) -> str | None:
    """Why the trainer's own ``view`` of the claimed step does not back ``claim`` (None: it does)."""
    if claim.type in _NON_FINITE_TYPES:
        agrees = view.non_finite
    elif claim.type in _OVERFLOW_TYPES:
        agrees = view.scaler_overflow or view.non_finite
    else:
        agrees = (
            view.non_finite
            or max(view.loss_z or 0.0, view.grad_z or 0.0) >= AGREE_Z
            or (claim.type in _LR_TYPES and view.lr_beyond_peak)
            or (claim.type in _SIGNAL_TYPES and view.signal_over)
        )
    if agrees:
        return None
    return (
        f"the decision calls step {claim.step} of epoch {claim.epoch} {claim.type.value}, but this "
        f"trainer saw {view.describe()} there (it agrees at z >= {AGREE_Z:g} or a non-finite value)"
    )


def _same(a: float | None, b: float | None) -> bool:
    # Values travel as JSON, which round-trips a float exactly; NaN is NaN's twin here.
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


class PublishedSteps:
    """The trainer's own view of its newest steps: (epoch, step) -> :class:`StepView`.

    Bounded: evidence older than ``size`` steps cannot be checked and is refused,
    as is evidence from before this process started (a resumed trainer remembers
    nothing it published before the restart).
    """

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        # A view, or own_view's arguments (keep): made into the view only when looked at.
        self._views: OrderedDict[tuple[int, int], StepView | tuple[Any, ...]] = OrderedDict()

    def remember(
        self,
        epoch: int,
        step: int,
        loss: float,
        grad_norm: float | None,
        view: StepView | None = None,
    ) -> None:
        """Keep step ``step`` of ``epoch``: its published values and (``view``) its local judgement."""
        # (the view's own judgement after the published values: _replace costs several times this)
        self.keep(
            epoch,
            step,
            StepView(loss, grad_norm, *view[2:]) if view is not None else StepView(loss, grad_norm),
        )

    def keep(self, epoch: int, step: int, view: StepView | tuple[Any, ...]) -> None:
        """Keep step ``step`` of ``epoch`` as ``view`` says (its published values in it: own_view),
        or, ``view`` a plain tuple of own_view's arguments, as ``own_view(*view)`` says, made
        when looked at (a step's view is looked at only when an action cites it)."""
        views = self._views
        key = (epoch, step)
        views[key] = view
        views.move_to_end(key)
        while len(views) > self.size:
            views.popitem(last=False)

    def __len__(self) -> int:
        return len(self._views)

    def view(self, epoch: int, step: int) -> StepView | None:
        found = self._views.get((epoch, step))
        return found if found is None or type(found) is StepView else own_view(*found)

    def problem(self, evidence: Evidence) -> str | None:
        """Why ``evidence`` is not what this trainer published (None when it is)."""
        where = f"step {evidence.step} of epoch {evidence.epoch}"
        found = self.view(evidence.epoch, evidence.step)
        if found is None:
            return (
                f"evidence names {where}, which this trainer did not publish (or not among "
                f"its last {self.size} steps)"
            )
        if not _same(evidence.loss, found.loss):
            return f"evidence loss {evidence.loss!r} at {where}, but this trainer published {found.loss!r}"
        if not _same(evidence.grad_norm, found.grad_norm):
            return (
                f"evidence grad_norm {evidence.grad_norm!r} at {where}, but this trainer "
                f"published {found.grad_norm!r}"
            )
        return None

    def claim_problem(
        self, claim: Claim, evidence: Evidence | None, agreed: bool = False
    ) -> str | None:
        """Why an action answering ``claim`` must not change the run (None: the trainer agrees).

        ``agreed``: the trainer backed this incident's claim before (ActionQueue.agreed_incidents);
        the claimed step must still be one it published, but need not look anomalous to it.
        """
        if evidence is not None and (evidence.step, evidence.epoch) != (claim.step, claim.epoch):
            return (
                f"the decision is about step {claim.step} of epoch {claim.epoch}, but its evidence "
                f"is of step {evidence.step} of epoch {evidence.epoch}"
            )
        view = self.view(claim.epoch, claim.step)
        if view is None:
            return (
                f"the decision names step {claim.step} of epoch {claim.epoch}, which this trainer "
                f"did not publish (or not among its last {self.size} steps)"
            )
        return None if agreed else disagreement(claim, view)
