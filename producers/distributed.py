"""Several ranks, one decision: the same action at the same step everywhere.

How ranks agree: only rank 0 reads the actions topic. At every step each
rank contributes a short vector of the same length to one all-gather: "my
loss or gradient is non-finite", — rank 0 only — "I have actions due now",
its loss and its gradient norm. Every rank combines the same rows alike
(the flags by MAX; the loss by MAX and mean, which the step event
publishes: a spike on any rank's data is a spike of the run). The vector
rides along with the step statistics, so it costs no extra device-to-host
transfer. When the reduced "due" flag is set, rank 0 broadcasts the due
actions (``broadcast_object_list``) and every rank applies that same list,
in that order, before this step's update. When any rank saw a non-finite
value, every rank skips the update. Ranks therefore never disagree about
what was applied at which step, whatever the timing of the bus; a rank that
is not rank 0 needs no bus connection at all.

Checkpoints are taken at the same steps on every rank (the decision is
deterministic; the first one, before any step, is decided by rank 0 and
shared, so a rank that starts late still writes its own): rank 0 writes the
full file, the other ranks a companion file with their own RNG state; the
checkpoint directory must be one every rank can read. Which checkpoint a
rollback or a resume loads is decided once, by rank 0, after its own saves
are on disk, and shared; every rank then reports whether it could read it
(``agree``), and all load it, or all fall back to the next older one, or all
fail with the same message (checkpointing.py). Whatever one rank decides for
all (which checkpoint, whether a plan is within the recovery budget) is decided
by ``decide``: an exception there is every rank's outcome, never one rank's
alone, so no rank is left waiting in a collective the others never enter.
A sharded model (FSDP2, DTensor) is written with
torch.distributed.checkpoint, every rank its own shards (sharded.py).

With a sharded model each rank holds a slice of every gradient, so a norm of
the local gradients is the norm of a slice. ``sharded_norms`` gives the norms
of the whole tensors from the slices with one all-reduce per step: each rank
sums the squares of its slices, slices that are copies (a replicated
placement) count on one coordinate only, and the squares are summed across
the mesh once.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from spikeguard.errors import SpikeguardError

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - a torch built without distributed
    DTensor = None  # type: ignore[assignment,misc]


class RanksFailed(SpikeguardError):
    """What rank 0 decides for every rank failed there: raised on every rank, with its message."""


def outcome_of(work: Callable[[], Any]) -> tuple[Any, str | None]:
    """``work()``'s value, or None and the exception it raised, as text: this rank's outcome."""
    try:
        return work(), None
    except Exception as exc:  # noqa: BLE001 - reported to every rank by the caller
        return None, f"{type(exc).__name__}: {exc}"[:1000]


class RankSync:
    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.enabled = (
            dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        )
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

    def flags(
        self,
        local_nonfinite: torch.Tensor,
        due: bool,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Every rank's flags, loss and gradient norm, combined; on device, not synced.

        ``any_nonfinite``: some rank saw a non-finite loss or gradient; ``any_due``:
        rank 0 has actions due; ``max_loss`` / ``max_grad_norm``: the largest of any
        rank, the inputs of the local skip rule, so that every rank decides alike
        (non-finite values become +inf, which the rule never judges); ``run_loss``
        and ``mean_loss``: the ranks' largest and mean loss as they are (a NaN on any
        rank stays NaN), what the step event publishes (see stats.across_ranks).

        One all-gather of a fixed-length vector per rank: its shape never depends on
        the rank (which gradients it has, whether it has any).
        """

        def finite(t: torch.Tensor | None) -> torch.Tensor:
            if t is None:
                return torch.tensor(-1.0, device=self.device)  # no gradient: below any norm
            t = t.detach().to(self.device).float().reshape(())
            return torch.where(torch.isfinite(t), t, torch.full_like(t, float("inf")))

        raw_loss = loss.detach().to(self.device).float().reshape(())
        vec = torch.stack(
            [
                local_nonfinite.to(self.device).float().reshape(()),
                torch.tensor(1.0 if due else 0.0, device=self.device),
                finite(loss),
                finite(grad_norm),
                raw_loss,
            ]
        )
        if self.enabled:
            gathered = [torch.empty_like(vec) for _ in range(self.world_size)]
            dist.all_gather(gathered, vec, group=self.group)
            rows = torch.stack(gathered)
        else:
            rows = vec.reshape(1, -1)
        top = rows.max(dim=0).values
        losses = rows[:, 4]
        return {
            "any_nonfinite": top[0],
            "any_due": top[1],
            "max_loss": top[2],
            "max_grad_norm": top[3],
            # (torch.max propagates NaN; the mean of the ranks' losses is the global batch's)
            "run_loss": losses.max(),
            "mean_loss": losses.mean(),
        }

    def broadcast(self, payload: list[dict] | None) -> list[dict]:
        """Rank 0's ``payload`` on every rank."""
        return self.share(payload) or []

    def share(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank: a decision taken once, by rank 0 (any picklable value)."""
        if not self.enabled:
            return value
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def decide(self, work: Callable[[], Any]) -> Any:
        """Rank 0's ``work()``, on every rank; RanksFailed on every rank when it raised there."""
        value, error = outcome_of(work) if self.rank == 0 else (None, None)
        if self.enabled:
            value, error = self.share((value, error))
        if error is not None:
            raise RanksFailed(error)
        return value

    def least(self, value: int) -> int:
        """The smallest of every rank's ``value`` (an input every rank must weigh alike)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def outcomes(self, error: str | None) -> list[str | None]:
        """Every rank's outcome of the same step (None: it succeeded), in rank order, on every rank."""
        if not self.enabled:
            return [error]
        errors: list[str | None] = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        return errors

    def agree(self, error: str | None) -> str | None:
        """None when every rank succeeded, else one message naming each rank that failed and
        why: the same text on every rank."""
        return failures(self.outcomes(error))

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier(group=self.group)


def failures(errors: list[str | None]) -> str | None:
    """One message for the ranks that failed (None: none did)."""
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    return "; ".join(failed) or None


def is_sharded(tensors: Sequence[torch.Tensor]) -> bool:
    """True when any of ``tensors`` is a DTensor (FSDP2's parameters and gradients are)."""
    return DTensor is not None and any(isinstance(t, DTensor) for t in tensors)


def local_tensors(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's slices (views: scaling them in place scales the DTensor's own storage)."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def sharded_norms(
    tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor] | None = None
) -> torch.Tensor:
    """The 2-norm of every whole tensor, on device, from this rank's slices: one all-reduce.

    Plain tensors beside the DTensors count as replicated (rank 0's copy). ``None``
    (a parameter without a gradient on this rank) counts as zero, so that the reduced
    vector has one entry per position on every rank: give every rank the same
    positions (all parameters, not the ones that happen to have a gradient), and
    ``like``, the parameters themselves, for where their mesh is.
    """
    tensors = [None if t is None else _no_partial(t) for t in tensors]
    present = [t for t in tensors if t is not None]
    group, coordinate = _mesh_group(list(like) if like is not None else present)
    squares_of: Iterator[torch.Tensor] = iter(
        torch.stack([n.float() for n in torch._foreach_norm(local_tensors(present))]) ** 2
        if present
        else []
    )
    zero = torch.zeros((), device=_device(present or like))
    squares = torch.stack([next(squares_of) if t is not None else zero for t in tensors])
    weights = torch.tensor(
        [0.0 if t is None else _weight(t, coordinate) for t in tensors], device=squares.device
    )
    squares = squares * weights
    dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    return squares.sqrt()


def _device(tensors: Sequence[torch.Tensor] | None) -> torch.device:
    return local_tensors(tensors[:1])[0].device if tensors else torch.device("cpu")


def _no_partial(t: torch.Tensor) -> torch.Tensor:
    # A pending sum is not a slice: its local norms do not add up. Gradients under FSDP2 are
    # sharded, never partial; anything else pays one redistribution here.
    if isinstance(t, DTensor) and any(p.is_partial() for p in t.placements):
        from torch.distributed.tensor import Replicate

        return t.redistribute(
            placements=[Replicate() if p.is_partial() else p for p in t.placements]
        )
    return t


def _mesh_group(tensors: Sequence[torch.Tensor]) -> tuple[Any, int]:
    """The process group spanning the DTensors' mesh, and this rank's index in it (0: count copies)."""
    meshes: list[Any] = []
    for t in tensors:  # (each fully_shard call may build its own, equal, mesh object)
        if isinstance(t, DTensor) and not any(t.device_mesh == m for m in meshes):
            meshes.append(t.device_mesh)
    if len(meshes) != 1:
        raise ValueError(
            f"sharded gradient norms need every DTensor on one device mesh, found {len(meshes)}"
        )
    mesh = meshes[0]
    if mesh.ndim == 1:
        return mesh.get_group(), mesh.get_local_rank()
    if (
        mesh.size() == dist.get_world_size()
    ):  # an N-d mesh over every rank: the default group spans it
        return None, dist.get_rank()
    raise ValueError(
        f"sharded gradient norms: a {mesh.ndim}-d mesh over {mesh.size()} of "
        f"{dist.get_world_size()} ranks is not supported"
    )


def _weight(t: torch.Tensor, rank_in_group: int) -> float:
    """1.0 where this rank's slice is counted; a replicated copy counts at coordinate 0 only."""
    if not isinstance(t, DTensor):
        return 1.0 if rank_in_group == 0 else 0.0
    coordinate: Sequence[int] = t.device_mesh.get_coordinate() or []
    for dim, placement in enumerate(t.placements):
        if placement.is_replicate() and coordinate[dim] != 0:
            return 0.0
    return 1.0
