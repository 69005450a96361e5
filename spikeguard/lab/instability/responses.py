"""Responses that act before the loss moves, on the mechanism signals of each step.

- :class:`QKClip` (Kimi K2's MuonClip): a head whose max attention logit passed
  ``threshold`` has its query and key rows rescaled by ``√(threshold/max)``
  each, so that head's logits shrink by ``threshold/max`` and its max returns
  to the threshold. Only the offending heads are touched.
- :class:`LRCut`: the update-to-parameter ratio says how far one step moves the
  weights. Above ``threshold`` the LR multiplier is cut to
  ``threshold/ratio_at_full_lr`` (scaled to the evidence, never below
  ``floor``); once the ratio the full LR would give has stayed under
  ``threshold·calm_fraction`` for ``calm_steps`` steps, the multiplier doubles
  back towards 1.
- :class:`ZLossOn`: when the log-partition z drifts more than ``drift`` from
  its level after warm-up, switch PaLM's z-loss on.

Each acts on a :class:`Trainer`-like object (``lr_scale``, ``z_loss``) and
returns a line saying what it did, or None.
"""

from __future__ import annotations

import math
from typing import Mapping

from spikeguard.lab.instability.model import LabGPT
from spikeguard.producers.signals import StepSignals
from spikeguard.producers.signals.qk_clip import QKHeads, clip_heads_, fused_qk_heads

__all__ = ["LRCut", "QKClip", "QKHeads", "ZLossOn", "fused_qk_heads", "lab_qk_heads"]


class QKClip:
    """Rescale the offending heads' W_q, W_k so their max logit returns to ``threshold``."""

    def __init__(self, layers: Mapping[str, QKHeads], threshold: float = 30.0) -> None:
        self.layers, self.threshold = dict(layers), threshold
        self.clipped = 0  # heads rescaled so far

    def after_step(self, step: int, signals: StepSignals, trainer) -> str | None:
        done = clip_heads_(self.layers, signals.attention_max, self.threshold)
        self.clipped += len(done)
        return f"qk_clip {' '.join(done)} to {self.threshold:g}" if done else None


class LRCut:
    """Cut the LR in proportion to the update ratio's excess; restore it when it calms."""

    def __init__(
        self,
        threshold: float = 0.05,
        floor: float = 0.05,
        calm_steps: int = 20,
        calm_fraction: float = 0.8,
        after: int = 0,
    ) -> None:
        self.threshold, self.floor = threshold, floor
        self.calm_steps, self.calm_fraction, self.after = calm_steps, calm_fraction, after
        self._calm = 0
        self.lowest = 1.0

    def after_step(self, step: int, signals: StepSignals, trainer) -> str | None:
        ratio = signals.max_update_ratio
        if step < self.after or not math.isfinite(ratio):
            return None
        at_full_lr = ratio / trainer.lr_scale  # the update is proportional to the LR
        if at_full_lr > self.threshold:
            self._calm = 0
            wanted = max(self.floor, min(1.0, self.threshold / at_full_lr))
            if wanted < trainer.lr_scale * 0.95:
                trainer.lr_scale = wanted
                self.lowest = min(self.lowest, wanted)
                return f"lr_cut x{wanted:.3f} (update ratio {at_full_lr:.3f} at full LR)"
            return None
        if trainer.lr_scale < 1.0 and at_full_lr < self.threshold * self.calm_fraction:
            self._calm += 1
            if self._calm >= self.calm_steps:
                self._calm = 0
                trainer.lr_scale = min(1.0, trainer.lr_scale * 2)
                return f"lr_restore x{trainer.lr_scale:.3f}"
        else:
            self._calm = 0
        return None


class ZLossOn:
    """Switch the z-loss on once z has drifted ``drift`` from its level at step ``after``."""

    def __init__(self, coefficient: float = 1e-4, drift: float = 1.0, after: int = 30) -> None:
        self.coefficient, self.drift, self.after = coefficient, drift, after
        self.reference: float | None = None

    def after_step(self, step: int, signals: StepSignals, trainer) -> str | None:
        if step < self.after or not math.isfinite(signals.z) or trainer.z_loss > 0:
            return None
        if self.reference is None:
            self.reference = signals.z
            return None
        if abs(signals.z - self.reference) > self.drift:
            trainer.z_loss = self.coefficient
            return f"z_loss on ({self.coefficient:g}): z {signals.z:.2f} from {self.reference:.2f}"
        return None


def lab_qk_heads(model: LabGPT) -> dict[str, QKHeads]:
    """The lab model's layers: separate ``q`` and ``k`` projections."""
    return {
        str(i): QKHeads(attn.q, 0, attn.k, 0, attn.q.out_features // attn.heads)
        for i, attn in enumerate(model.attentions())
    }
