"""Gradient clipping the guard can switch on or tighten: fixed norm, or adaptive.

Adaptive clipping keeps an exponential moving average of the gradient norm
and of its variance and clips to ``mean + z * std`` (z-score clipping). The
baseline learns only from clipped values, so the spike it clips does not
teach it that spikes are normal; the baseline is tracked from the first step
so it is ready the moment an action turns adaptive clipping on.

The clip decision uses the total norm the guard already brought to the host:
clipping costs one fused multiply, and no extra transfer.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch


class GradClipper:
    def __init__(
        self,
        beta: float = 0.98,
        warmup: int = 25,
        track_z: float = 6.0,
        own_max_norm: float | None = None,
    ) -> None:
        self.beta = beta
        self.warmup = warmup
        self.track_z = track_z
        # The user's own limit (GuardConfig.max_grad_norm): what a lift gives back, never loosened.
        self.own_max_norm = own_max_norm
        # Settings (changed by CLIP actions).
        self.max_norm: float | None = own_max_norm
        self.z: float | None = None
        # Learned baseline.
        self.mean = 0.0
        self.var = 0.0
        self.count = 0
        self.clipped = 0

    def recovery_bounds(self, own: float | None = None) -> str:
        """The clipping CLIP actions set beyond the user's own max_grad_norm ("": none)."""
        own = self.own_max_norm if own is None else own
        bounds = []
        if self.max_norm is not None and self.max_norm != own:
            bounds.append(f"max_norm {self.max_norm:g}")
        if self.z is not None:
            bounds.append(f"{self.z:g} deviations above the mean norm (adaptive)")
        return " and ".join(bounds)

    def set_fixed(self, max_norm: float) -> float:
        """Enable, or tighten (never loosen), fixed-norm clipping."""
        self.max_norm = max_norm if self.max_norm is None else min(self.max_norm, max_norm)
        return self.max_norm

    def set_adaptive(self, z: float) -> float:
        self.z = z if self.z is None else min(self.z, z)
        return self.z

    def lift(self, max_norm: float | None = None) -> str:
        """Give back the clipping actions set: to ``max_norm`` (None: to none but the user's own
        limit, which is never loosened); what is in force afterwards, in words."""
        own = self.own_max_norm
        if max_norm is None:
            self.max_norm, self.z = own, None
        else:
            self.max_norm = max_norm if own is None else min(max_norm, own)
        left = self.recovery_bounds()
        if left:
            return f"clipped at {left} now"
        return "no clipping now" if own is None else f"clipped at your own max_norm {own:g} now"

    def threshold(self) -> float | None:
        """The norm above which gradients are scaled down right now (None: no clipping)."""
        bounds = []
        if self.max_norm is not None:
            bounds.append(self.max_norm)
        if self.z is not None and self.count >= self.warmup:
            bounds.append(self.mean + self.z * math.sqrt(max(self.var, 0.0)))
        return min(bounds) if bounds else None

    def observe(self, norm: float) -> None:
        """Teach the baseline one (finite) gradient norm, capped at its tracking bound."""
        if not math.isfinite(norm):
            return
        if self.count >= self.warmup:
            norm = min(norm, self.mean + self.track_z * math.sqrt(max(self.var, 0.0)))
            if self.z is not None:
                norm = min(norm, self.mean + self.z * math.sqrt(max(self.var, 0.0)))
        if self.count == 0:
            self.mean, self.var = norm, 0.0
        else:
            delta = norm - self.mean
            self.mean += (1 - self.beta) * delta
            self.var = self.beta * (self.var + (1 - self.beta) * delta * delta)
        self.count += 1

    def clip(self, grads: Sequence[torch.Tensor], total_norm: float) -> float:
        """Scale ``grads`` in place if ``total_norm`` exceeds the threshold; returns the factor."""
        limit = self.threshold()
        if limit is None or not math.isfinite(total_norm) or total_norm <= limit:
            return 1.0
        factor = limit / (total_norm + 1e-6)
        torch._foreach_mul_(list(grads), factor)
        self.clipped += 1
        return factor

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_norm": self.max_norm,
            "z": self.z,
            "mean": self.mean,
            "var": self.var,
            "count": self.count,
            "clipped": self.clipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.max_norm = state.get("max_norm")
        self.z = state.get("z")
        self.mean = float(state.get("mean", 0.0))
        self.var = float(state.get("var", 0.0))
        self.count = int(state.get("count", 0))
        self.clipped = int(state.get("clipped", 0))

    def settings(self) -> dict[str, Any]:
        return {"max_norm": self.max_norm, "z": self.z}
