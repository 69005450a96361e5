"""The largest attention logit per layer and head, read from a hook on the attention's q·k.

Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer
training instabilities") find that without QK-layernorm the attention logits
of a transformer grow at high learning rates until the softmax collapses onto
one key (near-zero entropy) and the loss spikes; Kimi K2's QK-clip acts on the
same number, the per-head max logit. This module measures it.

The hook sits on a module whose forward takes ``(q, k)`` (shape ``batch,
heads, time, head_dim``) and returns the scaled logits ``q·kᵀ/√head_dim``:
:class:`AttentionScores`, which an attention calls instead of computing the
product inline. A model whose attention is fused (one ``qkv`` projection, then
``scaled_dot_product_attention``) never forms the logits; with ``qkv_heads``
the hook sits on the projection and forms them itself (one extra ``q·kᵀ``).
The max is taken on the device over the causal (visible) pairs only and kept
as a tensor: nothing leaves the device until
:meth:`AttentionLogitMax.collect`, once per step for every layer.

>>> import torch
>>> scores = AttentionScores()
>>> probe = AttentionLogitMax({"0": scores})
>>> q = torch.zeros(1, 2, 2, 4); k = torch.zeros(1, 2, 2, 4)
>>> q[0, 1, 1, 0] = 2.0; k[0, 1, 0, 0] = 3.0   # head 1, query 1 sees key 0: 2*3/sqrt(4)
>>> _ = scores(q, k)
>>> probe.collect()["0"].tolist()
[0.0, 3.0]
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
from torch import nn


class AttentionScores(nn.Module):
    """``q·kᵀ/√head_dim``: the attention logits, as a module so a hook can read them."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])


def causal_head_max(logits: torch.Tensor) -> torch.Tensor:
    """Per head, the largest logit a query may attend to (key at or before the query)."""
    t, s = logits.shape[-2], logits.shape[-1]
    hidden = torch.ones(t, s, dtype=torch.bool, device=logits.device).triu(s - t + 1)
    visible = logits.detach().masked_fill(hidden, float("-inf"))
    return visible.amax(dim=(-2, -1)).amax(dim=0)  # (heads,)


def fused_qkv_logits(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """The attention logits ``(batch, heads, time, time)`` of a fused ``(batch, time, 3·d)`` projection."""
    b, t, three_d = qkv.shape
    q, k, _ = qkv.view(b, t, 3, heads, three_d // (3 * heads)).permute(2, 0, 3, 1, 4)
    return (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])


class AttentionLogitMax:
    """Forward hooks on named :class:`AttentionScores` modules; per layer, the per-head max.

    ``causal`` (default) ignores the pairs a causal mask hides. Remove the
    hooks with :meth:`close` (or use the object as a context manager).
    """

    def __init__(
        self, layers: Mapping[str, nn.Module], causal: bool = True, qkv_heads: int | None = None
    ) -> None:
        self.causal, self.qkv_heads = causal, qkv_heads
        self._latest: dict[str, torch.Tensor] = {}
        self._handles = [
            module.register_forward_hook(self._hook(name)) for name, module in layers.items()
        ]

    def _hook(self, name: str):
        def record(module: nn.Module, inputs, output: torch.Tensor) -> None:
            if self.qkv_heads is not None:
                output = fused_qkv_logits(output.detach(), self.qkv_heads)
            if self.causal:
                self._latest[name] = causal_head_max(output)
            else:
                self._latest[name] = output.detach().amax(dim=(0, -2, -1))

        return record

    def pending(self) -> dict[str, torch.Tensor]:
        """The latest forward's per-head maxima, still on the device (no transfer)."""
        return dict(self._latest)

    def collect(self) -> dict[str, torch.Tensor]:
        """The latest per-head maxima on the CPU (one transfer for every layer), then forget them."""
        if not self._latest:
            return {}
        names = list(self._latest)
        flat = torch.cat([self._latest[n].float().reshape(-1) for n in names]).cpu()
        out, at = {}, 0
        for n in names:
            size = self._latest[n].numel()
            out[n] = flat[at : at + size]
            at += size
        self._latest.clear()
        return out

    def clear(self) -> None:
        self._latest.clear()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> AttentionLogitMax:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
