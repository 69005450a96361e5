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

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


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
    logs = [math.log(v) if v > 0 and math.isfinite(v) else (math.inf if v != 0 else -math.inf)
            for v in values]
    finite = [v for v in logs if math.isfinite(v)]
    if not finite:
        return [0.0] * len(values)
    center = statistics.median(finite)
    spread = max(1e-3, 1.4826 * statistics.median(abs(v - center) for v in finite))
    # A non-finite loss or gradient is as suspect as a sample can be.
    return [(v - center) / spread if math.isfinite(v) else (math.inf if v > 0 else 0.0) for v in logs]


def rank_samples(model: torch.nn.Module, items: Sequence[tuple[SampleId, int, Any]],
                 collate: Callable[[list[Any]], Any], loss_fn: LossFn) -> list[SampleScore]:
    """Each ``(sample_id, step, item)`` through ``model`` alone: its loss and gradient norm, ranked.

    ``item`` is what the dataset returns for that id; ``collate`` makes a batch
    of one. The model is left in its mode and its gradients cleared.
    """
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
    scores = [SampleScore(sid, step, loss, norm, lz, gz) for (sid, step, _), loss, norm, lz, gz
              in zip(items, losses, norms, _robust_z(losses), _robust_z(norms))]
    return sorted(scores, key=lambda s: -s.score)
