"""Several ranks, one decision: the same action at the same step everywhere.

How ranks agree: only rank 0 reads the actions topic. At every step each
rank contributes two flags to one tiny all-reduce (MAX): "my loss or gradient
is non-finite" and — rank 0 only — "I have actions due now". The flags ride
along with the step statistics, so they cost no extra device-to-host
transfer. When the reduced "due" flag is set, rank 0 broadcasts the due
actions (``broadcast_object_list``) and every rank applies that same list,
in that order, before this step's update. When any rank saw a non-finite
value, every rank skips the update. Ranks therefore never disagree about
what was applied at which step, whatever the timing of the bus; a rank that
is not rank 0 needs no bus connection at all.

Checkpoints are taken at the same steps on every rank (the decision is
deterministic): rank 0 writes the full file, the other ranks a companion
file with their own RNG state; the checkpoint directory must be one every
rank can read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class RankSync:
    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.enabled = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self.rank = dist.get_rank(group) if self.enabled else 0
        self.world_size = dist.get_world_size(group) if self.enabled else 1
        self.device = torch.device("cpu")
        if self.enabled and dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    def detect_rank() -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def flags(self, local_nonfinite: torch.Tensor, due: bool, loss: torch.Tensor,
              grad_norm: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """All-reduced (MAX) flags, loss and gradient norm, on device, not synced.

        ``any_nonfinite``: some rank saw a non-finite loss or gradient; ``any_due``:
        rank 0 has actions due; ``max_loss`` / ``max_grad_norm``: the largest of any
        rank, the inputs of the local skip rule, so that every rank decides alike
        (non-finite values become +inf, which the rule never judges).
        """
        def finite(t: torch.Tensor | None) -> torch.Tensor:
            if t is None:
                return torch.tensor(-1.0, device=self.device)  # no gradient: below any norm
            t = t.detach().to(self.device).float().reshape(())
            return torch.where(torch.isfinite(t), t, torch.full_like(t, float("inf")))
        vec = torch.stack([local_nonfinite.to(self.device).float().reshape(()),
                           torch.tensor(1.0 if due else 0.0, device=self.device),
                           finite(loss), finite(grad_norm)])
        if self.enabled:
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.group)
        return {"any_nonfinite": vec[0], "any_due": vec[1], "max_loss": vec[2], "max_grad_norm": vec[3]}

    def broadcast(self, payload: list[dict] | None) -> list[dict]:
        """Rank 0's ``payload`` on every rank."""
        if not self.enabled:
            return payload or []
        box = [payload if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0] or []

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)
