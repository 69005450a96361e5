"""The Guard's local skip-step rule: an isolated outlier step's update is skipped at once.

The pipeline is asynchronous: its verdict arrives after the update it judged
was applied. One kind of anomaly is cheap and urgent enough to handle in the
trainer itself: a single step whose loss (or gradient norm) jumps far above
the run's own noise and would come straight back, the batch-induced outlier
OLMo-core skips. This module decides that from the numbers the Guard already
has on the host, in plain Python (no torch).

What an outlier is, is not decided here: each signal has one
:class:`~spikeguard.processors.outlier_model.OutlierModel`, the same model
and the same defaults as the pipeline's level test, calibrated on the run's
own noise to at most one false outlier per 10,000 healthy steps per signal.
A step is skipped when its loss or its gradient norm is elevated, unless more
than ``max_run`` steps in a row have been: that is not an isolated outlier but
an incident (or a new level) for the pipeline to judge. Nor are elevated steps
interleaved with healthy ones (``FOLLOW_ELEVATED`` of the last twenty): the
signal's level moved up by less than a run of elevated points would show, and
the rule's level follows it at once (``OutlierConfig.follow_elevated``) rather
than skip the upper half of the noise for hundreds of steps. The pipeline's
level test keeps that off: it tells such a move from a climb by its own tests.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, NamedTuple

from spikeguard.processors.outlier_model import (
    NOT_JUDGED,
    Judged,
    OutlierConfig,
    grad_norm_config,
    loss_config,
    position,
    turns_signed,
)


#: elevated steps among the last ``follow_window`` (not one run) after which the level follows
FOLLOW_ELEVATED = 3


def following(config: OutlierConfig) -> OutlierConfig:
    """``config`` with the skip rule's level following an interleaved elevation."""
    return config.model_copy(update={"follow_elevated": FOLLOW_ELEVATED})


class SkipDecision(NamedTuple):
    """One step's local judgement (a NamedTuple: built every step, in the trainer's thread too)."""

    skip: bool
    #: "loss", "grad_norm", or both joined by "+": what was elevated (empty: nothing).
    signal: str = ""
    #: residual over threshold of each signal (1.0 at the threshold); None when not judged.
    loss_z: float | None = None
    grad_z: float | None = None
    #: an LR jump beyond any rate the run had trained at explains the step (Judged.lr_beyond_peak)
    lr_beyond_peak: bool = False


class StepJudged(NamedTuple):
    """A step judged and not yet learned (``SkipRule.judge``, then ``SkipRule.learn``)."""

    decision: SkipDecision
    #: the loss's position (its log, or itself once the loss has gone below zero; None: a zero,
    #: which has no log, so only its learning rate is learnt)
    log_loss: float | None = 0.0
    loss_judged: Judged | None = None  # None: the loss was non-finite (nothing to learn)
    log_grad: float | None = 0.0
    grad_judged: Judged | None = None
    lr: float | None = None
    #: the loss is the run's first below zero: its model starts over, signed
    turns_signed: bool = False


class SkipRule:
    """Decide, step by step, whether an update is an isolated outlier to skip.

    >>> import random
    >>> rng = random.Random(0)
    >>> rule = SkipRule()
    >>> quiet = [rule.decide(2.0 * (1 + rng.gauss(0, 0.01)), 1.0).skip for _ in range(400)]
    >>> any(quiet), rule.decide(2.6, 1.0).skip, rule.decide(2.0, 1.0).skip
    (False, True, False)
    """

    def __init__(
        self,
        loss: OutlierConfig | None = None,
        grad_norm: OutlierConfig | None = None,
        max_run: int = 2,
    ) -> None:
        if max_run < 1:
            raise ValueError(f"max_run must be >= 1, got {max_run}")
        self.loss = loss or following(loss_config())
        self.grad_norm = grad_norm or following(grad_norm_config())
        self.max_run = max_run
        self._loss = self.loss.model()
        self._grad = self.grad_norm.model()
        self.run = 0  # elevated steps in a row so far

    def decide(
        self, loss: float, grad_norm: float | None = None, lr: float | None = None
    ) -> SkipDecision:
        """Judge one step, then learn it. Non-finite values are not judged here (the Guard
        skips them on its own) and are never learned. ``lr`` is the step's learning rate:
        a recent rise of it explains a rise of the loss (a warm restart)."""
        judged = self.judge(loss, grad_norm, lr)
        self.learn(judged)
        return judged.decision

    def judge(
        self, loss: float, grad_norm: float | None = None, lr: float | None = None
    ) -> StepJudged:
        """Judge one step and change nothing: ``learn`` takes it in. The Guard learns only the
        values it keeps (a re-run's, when the first computation was a device's fault)."""
        if not math.isfinite(loss):
            return StepJudged(SkipDecision(False))
        starts = turns_signed(loss, self._loss.signed)
        y = position(loss, self._loss.signed or starts)
        # A fresh signed model judges the first negative loss (it warms up); learn() keeps one.
        model = self.loss.model(signed=True) if starts else self._loss
        loss_judged = NOT_JUDGED if y is None else model.judge(y, lr)
        g = None
        grad_judged: Judged | None = None
        if grad_norm is not None and math.isfinite(grad_norm):
            g = position(grad_norm, False)
            grad_judged = NOT_JUDGED if g is None else self._grad.judge(g, lr)
        loss_hit = loss_judged.elevated
        grad_hit = grad_judged is not None and grad_judged.elevated
        skip = (loss_hit or grad_hit) and self.run + 1 <= self.max_run
        decision = SkipDecision(
            skip,
            _SIGNALS[loss_hit, grad_hit],
            _score(loss_judged),
            _score(grad_judged),
            loss_judged.lr_beyond_peak,
        )
        return StepJudged(decision, y, loss_judged, g, grad_judged, lr, starts)

    def learn(self, judged: StepJudged) -> None:
        """Take a judged step in (nothing, for a non-finite loss)."""
        if judged.loss_judged is None:
            return
        self.run = self.run + 1 if judged.decision.signal else 0
        if judged.turns_signed:
            self._loss = self.loss.model(signed=True)
        self._loss.advance(judged.log_loss, judged.loss_judged, judged.lr)
        if judged.grad_judged is not None:
            self._grad.advance(judged.log_grad, judged.grad_judged, judged.lr)

    def state_dict(self) -> dict[str, Any]:
        return {"loss": self._loss.state_dict(), "grad": self._grad.state_dict(), "run": self.run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loss, self._grad = self.loss.model(), self.grad_norm.model()
        self.run = 0
        if not isinstance(state.get("loss"), dict):
            # A checkpoint from before the shared model (plain lists of values): the rule
            # starts afresh and warms up again rather than refuse the resume.
            return
        self._loss.load_state_dict(state["loss"])
        self._grad.load_state_dict(state["grad"])
        self.run = int(state.get("run", 0))


#: (loss elevated, gradient norm elevated) -> SkipDecision.signal
_SIGNALS = {
    (False, False): "",
    (True, False): "loss",
    (False, True): "grad_norm",
    (True, True): "loss+grad_norm",
}


def _score(judged: Judged | None) -> float | None:
    """How far out the point was (1.0: at the threshold); None during warm-up. A point an LR
    rise explains is not elevated, but its distance is still given: the trainer's own view of a
    step (evidence.py) must see an LR blow-up's loss for what it is."""
    if judged is None or not judged.threshold > 0.0:
        return None
    return round(judged.residual / judged.threshold, 3)


def scan(steps: Iterable[tuple[float, float | None]], **settings: Any) -> list[SkipDecision]:
    """The rule run offline over ``(loss, grad_norm)`` pairs, one decision per step."""
    rule = SkipRule(**settings)
    return [rule.decide(loss, grad) for loss, grad in steps]
