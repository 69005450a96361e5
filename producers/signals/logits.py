"""The output logits' log-partition z: the mean over positions of ``logsumexp(logits)``.

Wortsman et al. 2023 find a second instability of high learning rates: the
output logits drift (z runs away from 0, usually downwards) until the loss
diverges; PaLM's z-loss ``1e-4 · z²`` keeps z near 0 and fixes it. This module
measures z with a forward hook on the module that produces the logits (the LM
head), on the device; :meth:`LogPartition.collect` brings it to the CPU.

>>> import torch
>>> head = torch.nn.Identity()
>>> probe = LogPartition(head)
>>> _ = head(torch.zeros(2, 3, 4))     # logsumexp of four zeros is log 4
>>> round(probe.collect(), 4) == round(math.log(4), 4)
True
"""

from __future__ import annotations

import math

import torch
from torch import nn


def log_partition(logits: torch.Tensor) -> torch.Tensor:
    """Mean over every position of ``logsumexp`` over the last (vocabulary) axis, as a 0-d tensor."""
    return torch.logsumexp(logits.detach().float(), dim=-1).mean()


class LogPartition:
    """A forward hook on the LM head: the latest forward's mean log-partition z."""

    def __init__(self, head: nn.Module) -> None:
        self._latest: torch.Tensor | None = None
        self._handle = head.register_forward_hook(self._record)

    def _record(self, module: nn.Module, inputs, output: torch.Tensor) -> None:
        self._latest = log_partition(output)

    def pending(self) -> torch.Tensor | None:
        """The latest z, still on the device."""
        return self._latest

    def collect(self) -> float:
        """The latest z as a float (NaN before any forward), then forget it."""
        value = math.nan if self._latest is None else float(self._latest)
        self._latest = None
        return value

    def clear(self) -> None:
        self._latest = None

    def close(self) -> None:
        self._handle.remove()
