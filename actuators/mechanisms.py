"""The answer to a mechanism signal over its bar: act on the cause before the loss moves.

The rules detector flags ``attention_logit_growth`` when a step's largest
attention logit passes ``growth x`` the run's own level
(processors/detectors/mechanism.py); the decision's signals carry the value and
that bar. The policy answers it with two actions, both checked by the trainer
against its own measurements:

- ``qk_clip`` at ``qk_clip_bar_fraction x bar`` (Kimi K2's MuonClip): from then
  on, after every update, each head whose max logit passed it has its query and
  key rows rescaled back to it (producers/signals/prevention.py);
- an LR cut scaled to the evidence: to ``bar/value`` of the base LR (the
  further past the bar, the deeper), at most ``mechanism_lr_cut`` and never
  below the policy's LR floor. It is restored like every LR cut: after
  ``lr_restore_healthy_steps`` healthy decisions, that is once the signals
  have calmed.

A decision that comes while the logits are still over the bar repeats the
answer: the trainer keeps the lowest threshold it was sent, and the LR goes
lower only when the evidence asks for less than it already is.
"""

from __future__ import annotations

import math

from spikeguard.actuators.action_plan import ActionPlan
from spikeguard.actuators.config import PolicyConfig
from spikeguard.actuators.controls import Controls
from spikeguard.actuators.responses import Response
from spikeguard.schemas import AnomalyType, Decision
from spikeguard.schemas.actions import QkClipParams

#: The decision types answered here (the rules detector's mechanism rules).
MECHANISM_TYPES = frozenset({AnomalyType.ATTENTION_LOGIT_GROWTH})
_DEEPER = 0.95  # an LR already within 5 % of what the evidence asks for is left alone


def answer_mechanism(
    plan: ActionPlan, decision: Decision, controls: Controls, config: PolicyConfig
) -> None:
    """Add the ``qk_clip`` and the LR cut that answer ``decision``."""
    signals = decision.signals
    value = _number(signals.get("attention_logit_growth"))
    bar = _number(signals.get("attention_logit_growth_bar"))
    plan.response = Response.MECHANISM
    what = f"attention logit {value:.4g} at step {decision.step}, over the run's bar {bar:.4g}"
    if not (math.isfinite(bar) and bar > 0.0):
        plan.alert("warning", f"{what}: no bar to clip to; watching")
        return
    threshold = config.qk_clip_bar_fraction * bar
    plan.add(
        QkClipParams(threshold=threshold),
        f"{what}: QK-clip the heads over {threshold:.4g}",
    )
    # The LR (of base) the evidence asks for; a repeated decision with the same evidence
    # asks for nothing more.
    evidence = bar / value if math.isfinite(value) and value > 0.0 else 0.0
    wanted = max(config.min_lr_factor, min(config.mechanism_lr_cut, evidence))
    current = controls.lr.current
    if wanted < current * _DEEPER:
        controls.lower_lr(plan, wanted / current, f"{what}: cut the LR to x{wanted:.3g} of base")


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan
