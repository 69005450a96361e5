"""QK-clip (Kimi K2's MuonClip): rescale the heads whose max attention logit passed a threshold.

A head's logits are ``q·kᵀ/√d``; multiplying its query rows and its key rows
(weights and biases) by ``√(threshold/max)`` each multiplies its logits by
``threshold/max``, so its largest logit returns to the threshold and the
softmax stops collapsing onto one key. Only the offending heads are touched;
the others, and every value projection, keep their weights.

>>> import torch
>>> qkv = torch.nn.Linear(4, 12)          # q rows 0-3, k rows 4-7, two heads of 2
>>> heads = fused_qk_heads([type("Block", (), {"qkv": qkv, "heads": 2})()])
>>> before = qkv.weight[4:6].clone()
>>> clip_heads_(heads, {"0": [10.0, 40.0]}, threshold=10.0)
['0.1:40']
>>> torch.allclose(qkv.weight[4:6], before)   # head 0 was at the threshold: untouched
True
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

import torch
from torch import nn

_AT_THRESHOLD = 1.001  # a head just clipped reads back at the threshold, give or take rounding


class QKHeads(NamedTuple):
    """Where one layer's query and key rows live: ``head_dim`` rows per head from each start."""

    q: nn.Linear
    q_start: int
    k: nn.Linear
    k_start: int
    head_dim: int


@torch.no_grad()
def rescale_head_(layer: QKHeads, head: int, factor: float) -> None:
    """Multiply head ``head``'s query rows and key rows (weight and bias) by ``factor`` each."""
    for linear, start in ((layer.q, layer.q_start), (layer.k, layer.k_start)):
        rows = slice(start + head * layer.head_dim, start + (head + 1) * layer.head_dim)
        linear.weight[rows] *= factor
        if linear.bias is not None:
            linear.bias[rows] *= factor


def clip_heads_(
    layers: Mapping[str, QKHeads], attention_max: Mapping[str, Sequence[float]], threshold: float
) -> list[str]:
    """Rescale every head of ``layers`` whose max (``attention_max``: layer -> per head) passed
    ``threshold``; the heads rescaled, as ``layer.head:max``."""
    done = []
    for name, peaks in attention_max.items():
        layer = layers.get(name)
        if layer is None:
            continue
        for head, peak in enumerate(peaks):
            if math.isfinite(peak) and peak > threshold * _AT_THRESHOLD:
                rescale_head_(layer, head, math.sqrt(threshold / peak))
                done.append(f"{name}.{head}:{peak:.0f}")
    return done


def fused_qk_heads(
    blocks: Sequence[nn.Module], qkv: str = "qkv", heads: str = "heads"
) -> dict[str, QKHeads]:
    """Layers with one fused ``qkv`` projection (q rows first, then k, then v) and a number of
    attention heads (the attributes named by ``qkv`` and ``heads``)."""
    out = {}
    for i, block in enumerate(blocks):
        linear = getattr(block, qkv)
        d = linear.out_features // 3
        out[str(i)] = QKHeads(linear, 0, linear, d, d // int(getattr(block, heads)))
    return out
