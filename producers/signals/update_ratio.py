"""Update-to-parameter norm ratio per layer: ``‖θ_after − θ_before‖ / ‖θ_before‖``.

OLMo 2 and the Marin 32B retrospective report that update-norm spikes come
before loss spikes (and that not every one leads to a loss spike). Per layer,
so a single block running away is not averaged out by the rest.

:meth:`UpdateRatio.before` copies the watched parameters into buffers kept
from step to step (``torch._foreach_copy_``: no allocation after the first
step); :meth:`UpdateRatio.after` takes the per-layer norms on the device, and
:meth:`UpdateRatio.collect` brings them to the CPU in one transfer.

>>> import torch
>>> layer = torch.nn.Linear(2, 2, bias=False)
>>> with torch.no_grad(): _ = layer.weight.copy_(torch.tensor([[3.0, 0.0], [0.0, 4.0]]))
>>> ratio = UpdateRatio({"layer": list(layer.parameters())})
>>> ratio.before()
>>> with torch.no_grad(): _ = layer.weight.add_(torch.tensor([[0.5, 0.0], [0.0, 0.0]]))
>>> ratio.after()
>>> round(ratio.collect()["layer"], 6)   # 0.5 / 5
0.1
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn


def layer_groups(model: nn.Module, prefixes: Sequence[str]) -> dict[str, list[torch.Tensor]]:
    """Parameters by layer: those whose name starts with ``prefix + "."``, per prefix."""
    named = list(model.named_parameters())
    return {p: [t for n, t in named if n.startswith(p + ".")] for p in prefixes}


class UpdateRatio:
    """Per named group of parameters, the norm of the last update over the norm before it."""

    def __init__(self, layers: Mapping[str, Sequence[torch.Tensor]]) -> None:
        self.names = [n for n, params in layers.items() if params]
        self._params = [list(layers[n]) for n in self.names]
        self._flat = [p for group in self._params for p in group]
        self._saved: list[torch.Tensor] | None = None
        self._latest: torch.Tensor | None = None

    @torch.no_grad()
    def before(self) -> None:
        """Remember the parameters just before ``optimizer.step()``."""
        if self._saved is None:
            self._saved = [p.detach().clone() for p in self._flat]
        else:
            torch._foreach_copy_(self._saved, [p.detach() for p in self._flat])

    @torch.no_grad()
    def after(self) -> None:
        """Just after ``optimizer.step()``: the ratio per layer, kept on the device."""
        if self._saved is None:
            raise RuntimeError("UpdateRatio.after() without before()")
        deltas = torch._foreach_sub([p.detach() for p in self._flat], self._saved)
        delta_sq = torch.stack(torch._foreach_norm(deltas)) ** 2
        param_sq = torch.stack(torch._foreach_norm(self._saved)) ** 2
        sizes = [len(g) for g in self._params]
        delta_layer = torch.stack([s.sum() for s in delta_sq.split(sizes)])
        param_layer = torch.stack([s.sum() for s in param_sq.split(sizes)])
        self._latest = (delta_layer / param_layer.clamp_min(1e-30)).sqrt()

    def pending(self) -> torch.Tensor | None:
        """The latest ratios (one per layer, in ``names`` order), still on the device."""
        return self._latest

    def clear(self) -> None:
        self._latest = None

    def collect(self) -> dict[str, float]:
        """The latest ratios by layer name, then forget them."""
        if self._latest is None:
            return {}
        values = self._latest.tolist()
        self._latest = None
        return dict(zip(self.names, values))
