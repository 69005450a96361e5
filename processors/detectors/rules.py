"""Rules detector: hard limits that need no statistics to be sure.

Each rule names itself in the verdict (``rules``); several may fire at once and
the verdict's type is the most urgent one's. Non-finite values, an extreme
loss and an exploding gradient norm are *critical*: fusion acts on them alone.
The references the ratio rules compare with (a high quantile of the recent
healthy losses and gradient norms, so that the ordinary tail of a small
batch's loss is not extreme) are learnt only from steps on which no rule fired
(the base class does not learn an anomalous step), so a bad step never raises
the bar for the next one; the last learning rate and the loss-scale peak
follow every step.

A ratio alone has no false-alarm rate: on a heavy-tailed run (a loss near
zero with a hard batch now and then, the squared errors of heavy-tailed
targets) ordinary hard batches reach x100 and more over the reference. So a
ratio rule also needs the value beyond the run's own **healthy tail** of that
ratio: the recent healthy values themselves (the reference window), over their
median, extrapolated as a power law through their 90th and 99th percentiles
(:func:`~spikeguard.processors.outlier_model.power_law_bar`, as a signed loss's
residuals are) to ``tail_rate`` per healthy step. Only values the rules judged
healthy join, so a spike the run healed from never raises the bar for the next
one; hard batches the run has shown as ordinary, judged against a reference
that held one, do. Until the window holds ``reference_window`` values the ratio
alone decides.

>>> from spikeguard.schemas import StepEvent
>>> rules = RulesDetector()
>>> v = rules.update(StepEvent(run_id="r", step=0, loss=float("nan"), time=0.0))
>>> v.critical, v.rules
(True, ['loss_non_finite'])
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from spikeguard.processors.detectors.base import Detector, validate_verdict
from spikeguard.processors.detectors.mechanism import (
    MECHANISM_RULES,
    MechanismConfig,
    MechanismLevels,
    MechanismRules,
)
from spikeguard.processors.outlier_model import power_law_bar, turns_signed
from spikeguard.processors.robust_stats import RollingMedian
from spikeguard.schemas import AnomalyType, StepEvent, Verdict


class RulesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_loss: float = Field(
        1e4, gt=0.0, description="a loss above this is extreme, whatever came before"
    )
    extreme_loss_ratio: float = Field(
        10.0,
        gt=1.0,
        description="a loss this many times its recent reference (reference_quantile) is extreme",
    )
    tail_rate: float = Field(
        1e-6,
        gt=0.0,
        lt=0.01,
        description="false-alarm rate per healthy step of a ratio rule's tail (the rules are "
        "critical: ten times rarer than an outlier step's 1e-5); extrapolated as a power law",
    )
    max_grad_norm: float = Field(
        1e4, gt=0.0, description="a gradient norm above this is an explosion"
    )
    grad_norm_ratio: float = Field(
        14.0,
        gt=1.0,
        description="a gradient norm this many times its recent reference is an explosion "
        "(healthy runs show isolated jumps up to ~x8, exploding ones x20 and more)",
    )
    grad_persist_steps: int = Field(
        2,
        ge=1,
        le=16,
        description="a gradient norm over grad_norm_ratio with no loss rule firing is an explosion "
        "once it has lasted this many steps; before that it is only said in the verdict's "
        "signals (real ResNet/WMT runs have one-step jumps of x16-x134 that leave the loss alone)",
    )
    reference_window: int = Field(
        100, ge=3, le=4096, description="healthy steps the ratio rules' references are taken over"
    )
    reference_quantile: float = Field(
        0.99,
        ge=0.5,
        le=1.0,
        description="the reference is this quantile of those steps, not their median: a small "
        "batch's loss is heavy-tailed (a batch-1 loss 10x its median is ordinary; 10x its "
        "99th percentile is not)",
    )
    min_history: int = Field(8, ge=1, description="healthy steps before the ratio rules apply")
    lr_min: float = Field(
        0.0, description="a learning rate below this is out of bounds (0 is allowed)"
    )
    lr_max: float = Field(10.0, gt=0.0, description="a learning rate above this is out of bounds")
    lr_jump_ratio: float = Field(
        10.0,
        gt=1.0,
        description="a learning rate this many times the previous one is out of bounds, if it "
        "is also over lr_peak_ratio times the highest rate the run has trained at",
    )
    lr_peak_ratio: float = Field(
        1.5,
        gt=1.0,
        description="an LR jump counts only above this many times the highest LR the run has "
        "trained at: a warm restart returns to a rate the run knows (the outlier model's "
        "lr_rise, which says the same of an LR-induced rise)",
    )
    min_loss_scale: float = Field(
        1.0, gt=0.0, description="an fp16 loss scale below this has collapsed"
    )
    loss_scale_halvings: int = Field(
        8, ge=1, description="a loss scale this many halvings below its recent peak has collapsed"
    )
    loss_scale_window: int = Field(
        100, ge=2, le=4096, description="steps over which the peak is taken"
    )
    loss_scale_warmup: int = Field(
        20,
        ge=0,
        description="steps with a loss scale before the halving rule applies (scalers calibrate first)",
    )
    max_outlier_fraction: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="a batch with more outliers per input than this is anomalous",
    )
    max_label_fraction: float = Field(
        0.95,
        gt=0.0,
        le=1.0,
        description="a batch whose most frequent label has more than this share",
    )
    min_batch_size: int = Field(
        8, ge=1, description="smaller batches are not judged on outliers or labels"
    )
    mechanism: MechanismConfig = Field(
        default_factory=MechanismConfig,
        description="the mechanism signals' bars (steps that carry them: processors/detectors/"
        "mechanism.py)",
    )


# rule name -> (type, confidence, critical); the order is the precedence of the type.
RULES: dict[str, tuple[AnomalyType, float, bool]] = {
    "loss_non_finite": (AnomalyType.NON_FINITE, 1.0, True),
    "grad_norm_non_finite": (AnomalyType.NON_FINITE, 1.0, True),
    "non_finite_gradients": (AnomalyType.NON_FINITE, 1.0, True),
    "loss_above_max": (AnomalyType.EXTREME_LOSS, 1.0, True),
    "loss_ratio": (AnomalyType.EXTREME_LOSS, 0.95, True),
    "grad_norm_above_max": (AnomalyType.GRADIENT_EXPLOSION, 1.0, True),
    "grad_norm_ratio": (AnomalyType.GRADIENT_EXPLOSION, 0.95, True),
    "loss_scale_collapse": (AnomalyType.LOSS_SCALE_COLLAPSE, 0.8, False),
    "lr_non_finite": (AnomalyType.LR_OUT_OF_BOUNDS, 0.9, False),
    "lr_out_of_bounds": (AnomalyType.LR_OUT_OF_BOUNDS, 0.8, False),
    "lr_jump": (AnomalyType.LR_OUT_OF_BOUNDS, 0.7, False),
    "batch_non_finite_inputs": (AnomalyType.BAD_BATCH, 0.9, False),
    "batch_outliers": (AnomalyType.BAD_BATCH, 0.7, False),
    "batch_label_imbalance": (AnomalyType.BAD_BATCH, 0.65, False),
    # The mechanism signals: the loss has not moved yet (producers/signals).
    "attention_logit_growth": (AnomalyType.ATTENTION_LOGIT_GROWTH, 0.9, False),
    "update_ratio_high": (AnomalyType.LR_TOO_HIGH, 0.7, False),
}
_ORDER = {name: i for i, name in enumerate(RULES)}


class RulesState:
    """One run's references: recent quantiles of healthy steps, the loss-scale peak, the last LR."""

    __slots__ = (
        "loss",
        "grad",
        "scales",
        "scale_seen",
        "lr",
        "lr_peak",
        "grad_up",
        "signed",
        "mechanism",
    )

    def __init__(self, config: RulesConfig) -> None:
        self.loss = RollingMedian(config.reference_window)
        self.grad = RollingMedian(config.reference_window)
        self.scales = RollingMedian(config.loss_scale_window)  # recent log2 scales (for the peak)
        self.scale_seen = 0
        self.lr = math.nan
        self.lr_peak = 0.0  # the highest LR the run has trained at
        self.grad_up = 0  # steps in a row the gradient norm has been over grad_norm_ratio
        # The loss has gone below zero: it has no natural zero, so no ratio of it means anything
        # (the statistical detector judges it against its own noise).
        self.signed = False
        # The mechanism signals' healthy levels: made at a run's first step that carries them.
        self.mechanism: MechanismLevels | None = None


def _log_ratio(value: float | None, reference: float) -> float | None:
    """log(value / reference); None when either is not a positive finite number."""
    if value is None or not (0.0 < value < math.inf) or not (0.0 < reference < math.inf):
        return None
    return math.log(value / reference)


class RulesDetector(Detector[RulesState]):
    name: ClassVar[str] = "rules"
    state_version: ClassVar[int] = 2  # 2: grad_up

    def __init__(self, config: RulesConfig | None = None) -> None:
        self.config = config or RulesConfig()
        self.mechanism = MechanismRules(self.config.mechanism)
        super().__init__()

    def fresh(self) -> RulesState:
        return RulesState(self.config)

    def protects(self, verdict: Verdict) -> bool:
        # A mechanism signal over its bar says nothing about the loss or the gradient norm:
        # their references learn the step (the signal's own level does not, see track).
        return verdict.is_anomaly and not MECHANISM_RULES.issuperset(verdict.rules)

    def score(self, event: StepEvent, state: RulesState) -> Verdict:
        cfg = self.config
        fired: list[str] = []
        signals: dict[str, float] = {}
        loss, grad = event.loss, event.grad_norm
        loss_ok = math.isfinite(loss)
        grad_ok = grad is None or math.isfinite(grad)
        if not loss_ok:
            fired.append("loss_non_finite")
        if not grad_ok:
            fired.append("grad_norm_non_finite")
        if event.nonfinite_grads:
            fired.append("non_finite_gradients")
            signals["nonfinite_grads"] = event.nonfinite_grads
        if loss_ok:
            ref = self.scored(event, state, self._references)[0]
            beyond = self._beyond_tail(loss, state.loss)
            # (the absolute limit too yields to the run's own healthy tail: squared errors of
            # heavy-tailed targets reach it in a healthy run)
            if loss > cfg.max_loss and beyond:
                fired.append("loss_above_max")
            if ref > 0.0 and not state.signed and loss >= cfg.extreme_loss_ratio * ref and beyond:
                fired.append("loss_ratio")
                signals["loss_ratio"] = round(loss / ref, 3)
        if grad is not None and grad_ok:
            if grad > cfg.max_grad_norm:
                fired.append("grad_norm_above_max")
            ref = self.scored(event, state, self._references)[1]
            if (
                ref > 0.0
                and grad >= cfg.grad_norm_ratio * ref
                and self._beyond_tail(grad, state.grad)
            ):
                # One step up with no loss rule firing is said, not flagged (real runs
                # have such one-step jumps that leave the loss alone); it is an
                # explosion once it lasts, or with a loss rule.
                signals["grad_norm_ratio"] = round(grad / ref, 3)
                if fired or state.grad_up + 1 >= cfg.grad_persist_steps:
                    fired.append("grad_norm_ratio")
        if event.lr is not None:
            self._check_lr(event.lr, state, fired)
        if event.loss_scale is not None:
            self._check_loss_scale(event.loss_scale, state, fired)
        if event.batch is not None:
            self._check_batch(event, fired)
        if MechanismRules.carries(event):
            levels = state.mechanism or self.mechanism.fresh()
            for name, (value, bar) in self.mechanism.judge(event, levels).items():
                fired.append(name)
                signals[name] = value
                signals[f"{name}_bar"] = round(bar, 6)
        if fired and event.update_skipped:
            # the trainer skipped this update itself: its gradient never reached the weights
            signals["update_skipped"] = 1
        if not fired:
            return validate_verdict(
                {
                    "run_id": event.run_id,
                    "step": event.step,
                    "epoch": event.epoch,
                    "detector": self.name,
                    "is_anomaly": False,
                    "signals": signals,
                    "loss": loss,
                    "grad_norm": grad,
                }
            )
        fired.sort(key=_ORDER.__getitem__)
        kind, confidence, critical = RULES[fired[0]]
        return Verdict(
            run_id=event.run_id,
            step=event.step,
            epoch=event.epoch,
            detector=self.name,
            is_anomaly=True,
            type=kind,
            confidence=confidence,
            critical=critical,
            rules=fired,
            signals=signals,
            message=", ".join(fired),
            loss=loss,
            grad_norm=grad,
        )

    def track(self, event: StepEvent, state: RulesState, verdict: Verdict) -> None:
        # The schedule and the scaler move on either way: a jump is reported once.
        lr, scale = event.lr, event.loss_scale
        state.grad_up = state.grad_up + 1 if "grad_norm_ratio" in verdict.signals else 0
        state.signed = state.signed or turns_signed(event.loss, state.signed)
        if MechanismRules.carries(event):
            if state.mechanism is None:
                state.mechanism = self.mechanism.fresh()
            self.mechanism.learn(event, state.mechanism, verdict.rules)
        if lr is not None and math.isfinite(lr):
            state.lr = lr
            state.lr_peak = max(state.lr_peak, lr)
        if scale is not None and scale >= self.config.min_loss_scale and math.isfinite(scale):
            state.scale_seen += 1
            state.scales.update(math.log2(scale))

    def learn(self, event: StepEvent, state: RulesState) -> None:
        # Only healthy steps move the references and their tails, so a bad step never raises
        # the bar.
        # An exact zero (a hinge loss once learnt, and its gradient) says only that the batch
        # taught nothing: in a window of zeros the 99th percentile would be a sliver of the one
        # nonzero value, and every nonzero batch x100 over it.
        if math.isfinite(event.loss) and event.loss != 0.0:
            state.loss.update(event.loss)
        # A one-step grad-norm jump is said, not flagged; still not a healthy value to learn
        # (with a short history, the reference's high quantile would be that jump).
        if event.grad_norm and not state.grad_up:  # (None, or an exact zero: not learnt)
            state.grad.update(event.grad_norm)

    def _references(self, event: StepEvent, state: RulesState) -> tuple[float, float]:
        """The ratio rules' references, loss and gradient norm (through ``scored``: once per
        step for score and track)."""
        return self._reference(state.loss), self._reference(state.grad)

    def _beyond_tail(self, value: float, window: RollingMedian) -> bool:
        """``value`` over the median of the recent healthy values is beyond their tail of that
        ratio (a power law through their 90th and 99th percentiles, at ``tail_rate``; log is
        monotone, so the ratios' quantiles are those of the values); True while the window is
        too short to say (the ratio alone decides)."""
        if len(window) < self.config.reference_window:
            return True
        median = window.get()
        ratio = _log_ratio(value, median)
        lo = _log_ratio(window.quantile(0.9), median)
        hi = _log_ratio(window.quantile(0.99), median)
        if ratio is None or lo is None or hi is None:
            return True
        bar = power_law_bar(0.0, lo, hi, 0.9, 0.99, self.config.tail_rate)
        return not ratio <= bar  # (NaN, no spread to extrapolate: beyond)

    def _reference(self, window: RollingMedian) -> float:
        """A ratio rule's reference: the recent healthy values' high quantile (NaN: too few)."""
        if len(window) < self.config.min_history:
            return math.nan
        return window.quantile(self.config.reference_quantile)

    def _check_lr(self, lr: float, state: RulesState, fired: list[str]) -> None:
        cfg = self.config
        if not math.isfinite(lr):
            fired.append("lr_non_finite")
            return
        if lr < cfg.lr_min or lr > cfg.lr_max:
            fired.append("lr_out_of_bounds")
        prev = state.lr
        # A jump back to a rate the run trained at (a warm restart, an LR restored after a cut)
        # is the schedule, not a fault.
        beyond_peak = lr > cfg.lr_peak_ratio * state.lr_peak
        if prev > 0.0 and lr >= cfg.lr_jump_ratio * prev and beyond_peak:
            fired.append("lr_jump")

    def _check_loss_scale(self, scale: float, state: RulesState, fired: list[str]) -> None:
        cfg = self.config
        if not (scale >= cfg.min_loss_scale) or not math.isfinite(scale):
            fired.append("loss_scale_collapse")
            return
        # This step counts towards the warm-up (``track`` counts it for good).
        if (
            state.scale_seen + 1 > cfg.loss_scale_warmup
            and len(state.scales)
            and state.scales.max() - math.log2(scale) >= cfg.loss_scale_halvings
        ):
            fired.append("loss_scale_collapse")

    def _check_batch(self, event: StepEvent, fired: list[str]) -> None:
        cfg = self.config
        batch = event.batch
        assert batch is not None
        if batch.nan_inputs or batch.inf_inputs:
            fired.append("batch_non_finite_inputs")
        if batch.size >= cfg.min_batch_size:
            if batch.outliers > cfg.max_outlier_fraction * batch.size:
                fired.append("batch_outliers")
            if (
                batch.max_label_fraction is not None
                and batch.max_label_fraction > cfg.max_label_fraction
            ):
                fired.append("batch_label_imbalance")

    def copy(self, state: RulesState) -> RulesState:
        twin = RulesState.__new__(RulesState)
        twin.loss, twin.grad, twin.scales = (
            state.loss.copy(),
            state.grad.copy(),
            state.scales.copy(),
        )
        twin.scale_seen, twin.lr, twin.grad_up = state.scale_seen, state.lr, state.grad_up
        twin.lr_peak = state.lr_peak
        twin.signed = state.signed
        twin.mechanism = None if state.mechanism is None else state.mechanism.copy()
        return twin

    def dump(self, state: RulesState) -> dict[str, Any]:
        return {
            "loss": state.loss.state_dict(),
            "grad_norm": state.grad.state_dict(),
            "scales": state.scales.state_dict(),
            "scale_seen": state.scale_seen,
            "lr": state.lr,
            "lr_peak": state.lr_peak,
            "grad_up": state.grad_up,
            "signed": state.signed,
            # (only for a run that sends the mechanism signals: the others' snapshots stay small)
            **({"mechanism": state.mechanism.state_dict()} if state.mechanism is not None else {}),
        }

    def load(self, data: dict[str, Any]) -> RulesState:
        state = RulesState(self.config)
        state.loss.load_state_dict(data["loss"])
        state.grad.load_state_dict(data["grad_norm"])
        state.scales.load_state_dict(data["scales"])
        state.scale_seen = int(data["scale_seen"])
        state.lr = float(data["lr"])
        # (absent: a snapshot from before the peak was kept; its last LR is the best guess)
        state.lr_peak = float(data.get("lr_peak", state.lr if state.lr == state.lr else 0.0))
        state.grad_up = int(data["grad_up"])
        state.signed = bool(data.get("signed", False))
        if "mechanism" in data:  # absent: the run sent no mechanism signal (or predates them)
            state.mechanism = self.mechanism.fresh()
            state.mechanism.load_state_dict(data["mechanism"])
        return state
