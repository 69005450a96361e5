"""Which samples caused an incident: replay its batches from the checkpoint before the onset.

The Guard writes, at each incident, the sample ids of the batches in its
window and the checkpoint taken before the onset (``record.IncidentBatches``,
one JSON file). Here every one of those samples goes through that checkpoint's
model alone: its own loss and its own gradient norm. A sample that caused a
spike stands out on one of the two (a corrupted input blows up the gradient,
a wrong target the loss), so each sample's score is the larger of the two
robust z-scores (median and MAD over the window's samples, in log space:
both are positive and heavy-tailed). The ranking is a list of suspects for a
person and for a skip list; it changes nothing by itself.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from spikeguard.processors.robust_stats import robust_sigma

log = logging.getLogger(__name__)

SampleId = int | str
#: ``loss_fn(model, batch) -> per-sample losses`` (reduction "none"), for a collated batch.
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class SampleScore:
    sample_id: SampleId
    step: int  # the step whose batch held it
    loss: float
    grad_norm: float
    loss_z: float
    grad_z: float

    @property
    def score(self) -> float:
        return max(self.loss_z, self.grad_z)


def _robust_z(values: Sequence[float]) -> list[float]:
    logs = [
        math.log(v) if v > 0 and math.isfinite(v) else (math.inf if v != 0 else -math.inf)
        for v in values
    ]
    finite = [v for v in logs if math.isfinite(v)]
    if not finite:
        return [0.0] * len(values)
    center = statistics.median(finite)
    spread = max(1e-3, robust_sigma(finite, center))
    # A non-finite loss or gradient is as suspect as a sample can be.
    return [
        (v - center) / spread if math.isfinite(v) else (math.inf if v > 0 else 0.0) for v in logs
    ]


#: Bytes the per-sample gradients of one chunk may take (chunk size = this / the model's bytes).
CHUNK_BYTES = 256 * 2**20
MAX_CHUNK = 256


def rank_samples(
    model: torch.nn.Module,
    items: Sequence[tuple[SampleId, int, Any]],
    collate: Callable[[list[Any]], Any],
    loss_fn: LossFn,
) -> list[SampleScore]:
    """Each ``(sample_id, step, item)`` through ``model`` alone: its loss and gradient norm, ranked.

    ``item`` is what the dataset returns for that id; ``collate`` makes a batch
    of them. Samples go through in chunks, each sample's own gradient computed
    in one pass per chunk (``torch.func``: ``vmap`` of ``grad``), which gives
    what a batch of one gives; a model or batch ``vmap`` cannot take (a
    non-tensor field, an in-place op it refuses) is replayed one sample at a
    time instead. The model is left in its mode and its gradients cleared.
    """
    try:
        losses, norms = _batched(model, items, collate, loss_fn)
    except Exception as exc:  # noqa: BLE001 - vmap's refusals are of many kinds; the loop is exact
        log.info(
            "per-sample gradients in one pass did not work (%s: %s); replaying the %d "
            "samples one at a time",
            type(exc).__name__,
            exc,
            len(items),
        )
        losses, norms = _one_by_one(model, items, collate, loss_fn)
    scores = [
        SampleScore(sid, step, loss, norm, lz, gz)
        for (sid, step, _), loss, norm, lz, gz in zip(
            items, losses, norms, _robust_z(losses), _robust_z(norms)
        )
    ]
    return sorted(scores, key=lambda s: -s.score)


class _LossOf(torch.nn.Module):
    """``loss_fn(model, batch)`` as a module, so ``functional_call`` can swap the model's weights."""

    def __init__(self, model: torch.nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


def _batched(
    model: torch.nn.Module,
    items: Sequence[tuple[SampleId, int, Any]],
    collate: Callable[[list[Any]], Any],
    loss_fn: LossFn,
) -> tuple[list[float], list[float]]:
    from torch.func import functional_call, grad, vmap
    from torch.utils._pytree import tree_map

    wrapper = _LossOf(model, loss_fn)
    params = {
        f"model.{name}": p.detach() for name, p in model.named_parameters() if p.requires_grad
    }
    size = sum(p.numel() * p.element_size() for p in params.values())
    chunk = max(1, min(MAX_CHUNK, CHUNK_BYTES // max(size, 1)))

    def one(weights: dict[str, torch.Tensor], sample: Any) -> tuple[torch.Tensor, torch.Tensor]:
        loss = functional_call(
            wrapper, weights, (tree_map(lambda t: t.unsqueeze(0), sample),)
        ).sum()
        return loss, loss.detach()

    per_sample = vmap(grad(one, has_aux=True), in_dims=(None, 0), randomness="same")
    losses: list[float] = []
    norms: list[float] = []
    for start in range(0, len(items), chunk):
        batch = collate([item for _, _, item in items[start : start + chunk]])
        grads, loss = per_sample(params, batch)
        squares = sum(g.flatten(1).pow(2).sum(dim=1) for g in grads.values())
        losses += loss.tolist()
        norms += torch.sqrt(torch.as_tensor(squares)).tolist() if grads else [0.0] * len(loss)
    return losses, norms


def _one_by_one(
    model: torch.nn.Module,
    items: Sequence[tuple[SampleId, int, Any]],
    collate: Callable[[list[Any]], Any],
    loss_fn: LossFn,
) -> tuple[list[float], list[float]]:
    params = [p for p in model.parameters() if p.requires_grad]
    losses: list[float] = []
    norms: list[float] = []
    for _, _, item in items:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, collate([item])).sum()
        loss.backward()
        grads = [p.grad.detach().flatten() for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.cat(grads)).item() if grads else 0.0
        losses.append(float(loss.detach()))
        norms.append(norm)
    model.zero_grad(set_to_none=True)
    return losses, norms
