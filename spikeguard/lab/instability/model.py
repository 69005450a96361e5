"""The lab's transformer: a small pre-LN character GPT with the switches the mechanisms need.

The attention computes its logits through
:class:`~spikeguard.producers.signals.AttentionScores` (so the max-logit
signal hooks the real ``q·kᵀ``), and has an optional QK-layernorm (Wortsman et
al. 2023; Dehghani et al. 2023), the fix for attention-logit growth. The
z-loss, the fix for output-logit divergence, is in :func:`lm_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from spikeguard.producers.signals import AttentionScores


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a lab model."""

    vocab: int
    block: int = 32  # characters of context
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    qk_norm: bool = False  # LayerNorm on q and k per head (the fix for attention-logit growth)


class Attention(nn.Module):
    hidden: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, d = cfg.heads, cfg.d_model
        head_dim = d // cfg.heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.q_norm = nn.LayerNorm(head_dim) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(head_dim) if cfg.qk_norm else nn.Identity()
        self.scores = AttentionScores()
        mask = torch.ones(cfg.block, cfg.block, dtype=torch.bool).triu(1)
        self.register_buffer("hidden", mask, persistent=False)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q_norm(self.split(self.q(x)))
        k = self.k_norm(self.split(self.k(x)))
        logits = self.scores(q, k).masked_fill(self.hidden[:t, :t], float("-inf"))
        out = torch.softmax(logits, dim=-1) @ self.split(self.v(x))
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        d = cfg.d_model
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LabGPT(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Parameter(torch.zeros(cfg.block, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))

    def attentions(self) -> list[Attention]:
        return [cast(Block, block).attn for block in self.blocks]

    def attention_scores(self) -> dict[str, nn.Module]:
        """Layer name -> the module whose output is that layer's attention logits."""
        return {str(i): cast(Block, block).attn.scores for i, block in enumerate(self.blocks)}

    def layer_parameters(self) -> dict[str, list[torch.Tensor]]:
        """Layer name -> its parameters (embeddings and head as layers of their own)."""
        layers: dict[str, list[torch.Tensor]] = {"embed": [self.tok.weight, self.pos]}
        layers.update({str(i): list(b.parameters()) for i, b in enumerate(self.blocks)})
        layers["head"] = [*self.ln.parameters(), self.head.weight]
        return layers


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0) -> torch.Tensor:
    """Cross-entropy, plus ``z_loss · mean(logsumexp²)`` when ``z_loss`` > 0 (PaLM's z-loss)."""
    flat = logits.reshape(-1, logits.shape[-1])
    loss = F.cross_entropy(flat, targets.reshape(-1))
    if z_loss > 0:
        loss = loss + z_loss * torch.logsumexp(flat, dim=-1).pow(2).mean()
    return loss
