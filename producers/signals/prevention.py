"""The mechanism signals on a Guard's steps, and the responses to them the policy sends back.

Opt-in per model::

    guard = Guard(model, optimizer, ...)
    Prevention(guard, MechanismSignals({...: block.qkv}, qkv_heads=4), fused_qk_heads(blocks))

From then on every step event carries ``attention_logit_max`` and
``update_ratio`` (the largest over the watched layers and heads), measured in
the step's one extra device-to-host transfer, and the trainer answers the
policy's ``qk_clip`` action: after every update from then on, each head whose
max logit passed the action's threshold has its query and key rows rescaled
back to it (:mod:`.qk_clip`, Kimi K2's MuonClip). The trainer checks the
action against its own numbers: it rescales only heads it measured itself
over the threshold, so a ``qk_clip`` on a run whose logits are below it
changes nothing. The LR cut that comes with it is the Guard's own SCALE_LR, which
the trainer applies only when its own logits were over its agreement bar at the
decided step: half the detector's growth over their own level (evidence.py).

The Guard calls :meth:`before_update` and :meth:`after_update` around the
optimizer's step (its step halves' ``signals`` attribute, set here).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from spikeguard.processors.detectors.mechanism import MechanismConfig, RelativeBar
from spikeguard.producers.signals import MechanismSignals, StepSignals
from spikeguard.producers.signals.qk_clip import QKHeads, clip_heads_
from spikeguard.schemas import Action, ActionKind
from spikeguard.schemas.actions import QkClipParams


class Prevention:
    """One Guard's mechanism signals and the ``qk_clip`` in force (None: none yet)."""

    def __init__(
        self,
        guard: Any,
        signals: MechanismSignals,
        qk_heads: Mapping[str, QKHeads] | None = None,
    ) -> None:
        self.signals, self.qk_heads = signals, dict(qk_heads or {})
        self.qk_threshold: float | None = None
        self.clipped_heads = 0  # head rescalings made so far
        self.latest = StepSignals()
        # The trainer's own view of its logits (evidence.py): a decision's attention-logit
        # growth is backed when they passed half the detector's growth over their level.
        c = MechanismConfig()
        self.agreement = RelativeBar(
            1 + (c.attention_growth - 1) / 2, c.attention_floor / 2, c.window
        )
        self.level = self.agreement.fresh()
        self.over = False  # this step's logits passed the agreement bar
        if self.qk_heads:
            guard.on(ActionKind.QK_CLIP, self.apply_qk_clip)
        guard.halves.signals = self

    # -- the Guard's hooks ----------------------------------------------------------------
    def before_update(self) -> None:
        self.signals.before_update()

    def after_update(self) -> dict[str, float]:
        """After the optimizer's step: the step event's signal fields; QK-clip if in force."""
        self.signals.after_update()
        seen = self.latest = self.signals.collect()
        value = seen.max_attention_logit if seen.attention_max else None
        self.over = self.agreement.judge(value, self.level) is not None
        if not self.over:
            self.agreement.learn(value, self.level)
        if self.qk_threshold is not None:
            self.clipped_heads += len(
                clip_heads_(self.qk_heads, seen.attention_max, self.qk_threshold)
            )
        fields = {}
        if math.isfinite(seen.max_attention_logit):
            fields["attention_logit_max"] = seen.max_attention_logit
        if math.isfinite(seen.max_update_ratio):
            fields["update_ratio"] = seen.max_update_ratio
        return fields

    # -- the action -------------------------------------------------------------------------
    def apply_qk_clip(self, action: Action, guard: Any) -> str:
        params = action.params
        if not isinstance(params, QkClipParams):
            raise ValueError(f"a qk_clip handler got a {action.kind.value} action")
        # A later action never loosens an earlier one: the lowest threshold holds.
        held = self.qk_threshold
        threshold = params.threshold if held is None else min(held, params.threshold)
        self.qk_threshold = threshold
        now = clip_heads_(self.qk_heads, self.latest.attention_max, threshold)
        self.clipped_heads += len(now)
        measured = self.latest.max_attention_logit
        return (
            f"qk_clip in force at {threshold:.3g} (the largest logit measured here "
            f"{measured:.3g}); rescaled now: {' '.join(now) or 'none'}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "qk_threshold": self.qk_threshold,
            "clipped_heads": self.clipped_heads,
            "level": self.level.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.qk_threshold = state["qk_threshold"]
        self.clipped_heads = int(state["clipped_heads"])
        self.level.load_state_dict(state["level"])
