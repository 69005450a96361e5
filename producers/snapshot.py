"""What a checkpoint holds, and putting it back.

Only tensors, dicts, lists, tuples, numbers and strings, so that a checkpoint
loads with ``torch.load(weights_only=True)``: model, optimizer, scheduler,
grad scaler, RNG states, data position, and the guard's own state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spikeguard.producers import rng

if TYPE_CHECKING:  # pragma: no cover
    from spikeguard.producers.guard import Guard


def capture(guard: "Guard") -> dict[str, Any]:
    if guard.rank != 0:  # the others keep only what is theirs alone
        return {"rng": rng.capture()}
    payload: dict[str, Any] = {
        "model": guard.model.state_dict(),
        "optimizer": guard.optimizer.state_dict(),
        "rng": rng.capture(),
        "data": guard.data_state(),
        "guard": guard.state_dict(),
    }
    if guard.scheduler is not None:
        payload["scheduler"] = guard.scheduler.state_dict()
    if guard.scaler is not None:
        payload["scaler"] = guard.scaler.state_dict()
    return payload


def restore(guard: "Guard", body: dict[str, Any]) -> None:
    """Put model, optimizer, scheduler, scaler, RNG, data position and guard state back.

    The guard's applied-action ids are merged (never replaced), and skip ranges
    are kept: neither a rollback nor a restart may forget them.
    """
    guard.model.load_state_dict(body["model"])
    guard.optimizer.load_state_dict(body["optimizer"])
    if guard.scheduler is not None and "scheduler" in body:
        guard.scheduler.load_state_dict(body["scheduler"])
    if guard.scaler is not None and "scaler" in body:
        guard.scaler.load_state_dict(body["scaler"])
    own = body.get("rank_state", {}).get("rng") if guard.rank else None
    rng.restore(own if own is not None else body["rng"])
    guard.load_state_dict(body.get("guard", {}))
    guard.set_data_state(body.get("data"))
    for p in guard.model.parameters():
        p.grad = None
