"""Mechanism signals: what a transformer's instabilities show before the loss does.

Opt-in per model and cheap: forward hooks and one parameter copy, reduced on
the device, and one device-to-host transfer per step for all of them
(:meth:`MechanismSignals.collect`).

- the max attention logit per layer and head (:mod:`.attention`);
- the output logits' log-partition z (:mod:`.logits`);
- the update-to-parameter norm ratio per layer (:mod:`.update_ratio`).

docs/instability.md says which of them lead the loss, on which mechanism, and
which warn on healthy runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import nn

from spikeguard.producers.signals.attention import (
    AttentionLogitMax,
    AttentionScores,
    causal_head_max,
)
from spikeguard.producers.signals.logits import LogPartition, log_partition
from spikeguard.producers.signals.update_ratio import UpdateRatio, layer_groups

__all__ = [
    "AttentionLogitMax",
    "AttentionScores",
    "LogPartition",
    "MechanismSignals",
    "StepSignals",
    "UpdateRatio",
    "causal_head_max",
    "layer_groups",
    "log_partition",
]


@dataclass(frozen=True)
class StepSignals:
    """One step's signals; an empty mapping or NaN for a signal that is off."""

    attention_max: dict[str, list[float]] = field(default_factory=dict)  # layer -> per head
    z: float = float("nan")
    update_ratio: dict[str, float] = field(default_factory=dict)  # layer -> ratio

    @property
    def max_attention_logit(self) -> float:
        """The largest logit over every layer and head (NaN when attention is off)."""
        values = [v for heads in self.attention_max.values() for v in heads]
        return max(values) if values else float("nan")

    @property
    def max_update_ratio(self) -> float:
        """The largest per-layer update ratio (NaN when that signal is off)."""
        return max(self.update_ratio.values()) if self.update_ratio else float("nan")


class MechanismSignals:
    """The three signals of one model; each is on when its argument is given.

    ``attention``: layer name -> its :class:`AttentionScores` module; ``head``:
    the module that returns the output logits; ``layers``: layer name -> its
    parameters, for the update ratio (call :meth:`before_update` and
    :meth:`after_update` around ``optimizer.step()``). ``qkv_heads``: the
    ``attention`` modules are fused q/k/v projections of that many heads
    (:func:`~spikeguard.producers.signals.attention.fused_qkv_logits`).
    """

    def __init__(
        self,
        attention: Mapping[str, nn.Module] | None = None,
        head: nn.Module | None = None,
        layers: Mapping[str, Sequence[torch.Tensor]] | None = None,
        qkv_heads: int | None = None,
    ) -> None:
        self.attention = AttentionLogitMax(attention, qkv_heads=qkv_heads) if attention else None
        self.z = LogPartition(head) if head is not None else None
        self.update = UpdateRatio(layers) if layers else None

    def before_update(self) -> None:
        if self.update is not None:
            self.update.before()

    def after_update(self) -> None:
        if self.update is not None:
            self.update.after()

    def collect(self) -> StepSignals:
        """This step's signals on the CPU, in one transfer, then forget them."""
        parts: list[torch.Tensor] = []
        att = self.attention.pending() if self.attention is not None else {}
        parts += [t.float().reshape(-1) for t in att.values()]
        z = self.z.pending() if self.z is not None else None
        if z is not None:
            parts.append(z.float().reshape(1))
        ratio = self.update.pending() if self.update is not None else None
        if ratio is not None:
            parts.append(ratio.float().reshape(-1))
        if not parts:
            return StepSignals()
        flat = torch.cat(parts).tolist()
        at = 0
        attention_max: dict[str, list[float]] = {}
        for name, t in att.items():
            attention_max[name] = flat[at : at + t.numel()]
            at += t.numel()
        z_value = float("nan")
        if z is not None:
            z_value = flat[at]
            at += 1
        update_ratio: dict[str, float] = {}
        if ratio is not None and self.update is not None:
            update_ratio = dict(zip(self.update.names, flat[at : at + ratio.numel()]))
        self._forget()
        return StepSignals(attention_max, z_value, update_ratio)

    def _forget(self) -> None:
        for signal in (self.attention, self.z, self.update):
            if signal is not None:
                signal.clear()

    def close(self) -> None:
        if self.attention is not None:
            self.attention.close()
        if self.z is not None:
            self.z.close()
