"""Per-step statistics at the cost of one device-to-host transfer.

Everything is computed on the device the gradients live on: per-parameter
norms with ``torch._foreach_norm`` (one fused kernel per dtype/device group),
stacked, reduced, the top-k picked, the optional batch statistics appended;
then a single ``tolist()`` brings the whole vector to the host. No
per-parameter ``.item()``: each one would be a synchronisation.

Counting the non-finite gradient *elements* needs one kernel per parameter,
so it only runs when the total norm already says something is non-finite:
a healthy step never pays for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from spikeguard.producers.distributed import is_sharded, local_tensors, sharded_norms


class LayerNorms(NamedTuple):
    """Per-parameter gradient norms in host memory, their top ``k`` picked when first read.

    On the CPU the pick is no transfer: it is left to whoever reads the step's top norms (the
    publisher's thread, building the StepEvent) rather than made on the training thread. The
    same ``topk`` of the same vector: the same values and names, in the same order."""

    norms: torch.Tensor
    names: list[str]
    k: int

    def pick(self) -> dict[str, float]:
        values, index = torch.topk(self.norms, self.k)
        names = self.names
        return {names[i]: v for i, v in zip(index.tolist(), values.tolist())}


@dataclass
class StepStats:
    loss: float
    grad_norm: float | None
    #: the largest per-parameter gradient norms by name (``top_grad_norms``), or their vector
    #: still to pick them from
    top: dict[str, float] | LayerNorms = field(default_factory=dict)
    nonfinite_grads: int = 0
    param_norm: float | None = None
    batch: dict | None = None
    #: Named values that rode along with the same transfer (see ``GradStats.compute``).
    riders: dict[str, float] = field(default_factory=dict)
    #: With several ranks (see ``across_ranks``): ``loss`` is the largest rank's, this the
    #: ranks' mean, ``ranks`` how many; ``rank_loss`` this rank's own.
    loss_mean: float | None = None
    ranks: int | None = None
    rank_loss: float | None = None
    #: The norm of the previous step's parameter update (update_norm.py); None: there was none.
    update_norm: float | None = None

    @property
    def top_grad_norms(self) -> dict[str, float]:
        top = self.top
        if type(top) is LayerNorms:
            top = self.top = top.pick()  # (two threads picking at once pick the same)
        return top  # type: ignore[return-value]

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and (
            self.grad_norm is None or math.isfinite(self.grad_norm)
        )


class GradStats:
    """Computes :class:`StepStats` for a fixed set of named parameters."""

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
        top_k: int = 5,
        param_norm: bool = False,
    ) -> None:
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.top_k = top_k
        self.param_norm = param_norm
        # FSDP2 / DTensor parameters: norms of the whole tensors, one all-reduce (distributed.py).
        self.sharded = is_sharded(self.params)

    def grads(self) -> tuple[list[str], list[torch.Tensor]]:
        names, grads = [], []
        for name, p in zip(self.names, self.params):
            if (grad := p.grad) is not None:
                names.append(name)
                grads.append(grad)
        return names, grads

    def clip_targets(self) -> list[torch.Tensor]:
        """The gradients as they are now, as ``compute`` returns them for clipping (a sharded
        model's local shards)."""
        grads = self.grads()[1]
        return local_tensors(grads) if self.sharded and self.params else grads

    def compute(
        self,
        loss: torch.Tensor | float,
        batch: Sequence | None = None,
        riders: Callable[
            [torch.Tensor, torch.Tensor, torch.Tensor | None], Mapping[str, torch.Tensor]
        ]
        | None = None,
        update: Sequence[torch.Tensor] | None = None,
    ) -> tuple[StepStats, list[torch.Tensor]]:
        """Statistics of the gradients as they are now, and the gradient list (for clipping).

        ``riders(nonfinite, loss, total_norm)`` gets a device flag (1.0 when the loss or
        the total norm is non-finite), the loss and the total norm, and returns named scalar tensors that ride
        along with the same transfer (the flags all-reduced across ranks, the loss
        scale); they come back by name in ``StepStats.riders``.
        ``update``: the last optimizer update, one tensor per parameter (update_norm.py);
        its total norm is taken with the gradients' (sharded: in the same all-reduce).
        """
        names, grads = self.grads()
        weights = [p.detach() for p in self.params] if self.param_norm else []
        update = list(update) if update is not None else []
        parts: list[torch.Tensor] = []
        device = grads[0].device if grads else torch.device("cpu")
        sharded_norm_list = None
        if self.sharded and self.params:
            # A collective: every rank reduces one entry per parameter, gradient or not
            # (a parameter unused on one rank must not change the vector's length there),
            # and the parameter and update norms in the same vector: one all-reduce.
            n, m = len(self.params), len(weights)
            tensors: list[torch.Tensor | None] = [p.grad for p in self.params]
            tensors.extend(weights)
            tensors.extend(update)
            all_norms = sharded_norms(tensors, like=self.params)
            sharded_norm_list = all_norms[
                [i for i, p in enumerate(self.params) if p.grad is not None]
            ]
            other_norms = [all_norms[n : n + m], all_norms[n + m :]]
            device = all_norms.device
        else:
            # One fused kernel for every norm, one stack: per-parameter work stays on the device.
            flat = (
                list(torch._foreach_norm(grads + weights + update))
                if grads or weights or update
                else []
            )
            g, m = len(grads), len(weights)
            # Stacked, then made float: the same values as making each norm float first
            # (widening is exact; a double norm is rounded once either way).
            every = torch.stack(flat) if flat else torch.zeros(0, device=device)
            if every.dtype != torch.float32:
                every = every.float()
            # Sliced only where there is more than one kind of norm (each slice is a call).
            grad_norms = every if not (weights or update) else every[:g]
            other_norms = [
                every[g : g + m] if weights else every,
                (every[g + m :] if g + m else every) if update else every,
            ]
        # The loss as a 1-element float vector on the norms' device: no call that changes nothing.
        loss_t = (
            loss.detach().reshape(1)
            if isinstance(loss, torch.Tensor)
            else torch.tensor([float(loss)])
        )
        if loss_t.dtype != torch.float32:
            loss_t = loss_t.float()
        if loss_t.device != device:
            loss_t = loss_t.to(device)
        parts.append(loss_t)
        k = min(self.top_k, len(grads))
        total = None
        layers: LayerNorms | None = None
        if grads:
            if (
                sharded_norm_list is not None
            ):  # the global norm, not this rank's slice; clipping scales the slices
                norms, grads = sharded_norm_list, local_tensors(grads)
            else:
                norms = grad_norms
            total = torch.linalg.vector_norm(norms, keepdim=True)  # shape (1,): no reshape
            parts.append(total)
            if k and sharded_norm_list is None and norms.device.type == "cpu":
                layers = LayerNorms(norms, names, k)  # picked when read: not here
            elif k:
                values, index = torch.topk(norms, k)
                parts += [values, index]  # (cat makes the indices float32 as .float() would)
        for wanted, norms in zip((weights, update), other_norms):
            if wanted:
                norm = torch.linalg.vector_norm(norms, keepdim=True)
                parts.append(norm if norm.device == device else norm.to(device))
        n_batch = 0
        if batch is not None:
            batch_parts = batch_statistics(batch)
            n_batch = len(batch_parts)
            parts += [t.to(device).float().reshape(1) for t in batch_parts]
        rider_names: list[str] = []
        if riders is not None:
            bad = ~torch.isfinite(parts[0][0])
            if total is not None:
                bad = bad | ~torch.isfinite(total[0])
            for name, value in riders(
                bad.float(), parts[0][0], None if total is None else total[0]
            ).items():
                rider_names.append(name)
                parts.append(value.to(device).float().reshape(1))
        values_list = torch.cat(parts).tolist()  # the one device-to-host transfer

        it = iter(values_list)
        loss_v = next(it)
        grad_norm = next(it) if grads else None
        top: dict[str, float] | LayerNorms = {}
        if layers is not None:
            top = layers
        elif grads and k:
            vals = [next(it) for _ in range(k)]
            idx = [int(next(it)) for _ in range(k)]
            top = {names[i]: v for i, v in zip(idx, vals)}
        pnorm = next(it) if weights else None
        unorm = next(it) if update else None
        bstats = None
        if n_batch:
            size, nan_in, inf_in, outliers, max_frac = (next(it) for _ in range(5))
            bstats = {
                "size": int(size),
                "nan_inputs": int(nan_in),
                "inf_inputs": int(inf_in),
                "outliers": int(outliers),
                "max_label_fraction": None if max_frac < 0 else min(1.0, max(0.0, max_frac)),
            }
        riding = {name: next(it) for name in rider_names}
        nonfinite = 0
        if grad_norm is not None and not math.isfinite(grad_norm):
            nonfinite = count_nonfinite(grads)  # rare path: a second transfer is fine here
        return StepStats(
            loss_v, grad_norm, top, nonfinite, pnorm, bstats, riding, update_norm=unorm
        ), grads


def across_ranks(stats: StepStats, world_size: int) -> StepStats:
    """The step as the run saw it: the loss is the largest of any rank's, with their mean beside it.

    The pipeline judges the run from rank 0's events; a spike in one rank's data
    shows in that rank's loss only (the gradients are averaged, and so diluted), so
    the published loss is the maximum across ranks (``RankSync.flags`` gathered
    them with the step's statistics: no extra transfer).
    """
    r = stats.riders
    return replace(
        stats, loss=r["run_loss"], loss_mean=r["mean_loss"], ranks=world_size, rank_loss=stats.loss
    )


def count_nonfinite(tensors: Sequence[torch.Tensor]) -> int:
    if not tensors:
        return 0
    return int(torch.stack([(~torch.isfinite(t)).sum() for t in tensors]).sum().item())


def batch_statistics(batch: Sequence, outlier_z: float = 6.0) -> list[torch.Tensor]:
    """size, NaN inputs, Inf inputs, outliers, share of the most frequent label (-1: none).

    ``batch`` is ``(inputs, labels)`` or ``(inputs,)``; integer labels give the
    label share, floating inputs the NaN/Inf/outlier counts. All on device.
    """
    inputs = batch[0]
    labels = batch[1] if len(batch) > 1 else None
    size = torch.tensor(float(inputs.shape[0] if inputs.dim() else 1))
    if inputs.is_floating_point():
        x = inputs.detach()
        nan_in = torch.isnan(x).sum()
        inf_in = torch.isinf(x).sum()
        finite = torch.where(torch.isfinite(x), x, torch.zeros_like(x)).float()
        mean, std = finite.mean(), finite.std() if finite.numel() > 1 else torch.tensor(0.0)
        outliers = ((finite - mean).abs() > outlier_z * std.clamp_min(1e-12)).sum()
    else:
        nan_in = inf_in = outliers = torch.tensor(0.0)
    if labels is not None and not labels.is_floating_point() and labels.numel():
        flat = labels.detach().reshape(-1).long()
        counts = torch.bincount(flat - flat.min())
        max_frac = counts.max().float() / flat.numel()
    else:
        max_frac = torch.tensor(-1.0)
    return [size, nan_in.float(), inf_in.float(), outliers.float(), max_frac]
