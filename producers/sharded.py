"""A sharded model's checkpoint part: torch.distributed.checkpoint, every rank writes its own shards.

Under FSDP2 (``fully_shard``) or any DTensor model, ``model.state_dict()`` on
one rank holds that rank's slices only: rank 0's ``torch.save`` of it would
be a checkpoint of half a model. This part hands the model's and the
optimizer's sharded state to ``torch.distributed.checkpoint`` (DCP) through
the state-dict API of ``torch.distributed.checkpoint.state_dict`` (keys are
parameter names, so the optimizer state follows the parameters), and the
checkpoint store writes it into one directory per checkpoint with
``dcp.save``: each rank its own file, plus the metadata. Loading reads each
rank's slices into copies (``dcp.load``, collective: ``read_state``), then
sets them through the same API, so a read that fails leaves the live state alone.

The part's state is ``{DCP_KEY: {"model": ..., "optimizer": ...}, ...}``:
the store writes what is under ``DCP_KEY`` with DCP and keeps the directory's
path there in the small per-rank file; a loaded state carries that path.

An optimizer that has not stepped yet has no state, and asking the
state-dict API for it would take a zero step to create one (Adam's step
count would start at 1): such a checkpoint keeps the parameter groups only,
and loading it empties the optimizer's state, as it was.

Saving is collective (every rank calls ``dcp.save`` at the same step, which
the guard's deterministic checkpoint schedule ensures), so it runs on the
training thread: DCP's collectives in a background thread would interleave
with the training's own on the same process group.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch

from spikeguard.errors import ConfigError
from spikeguard.producers.distributed import is_sharded

DCP_KEY = "dcp"


def model_is_sharded(model: torch.nn.Module) -> bool:
    """FSDP2 / DTensor parameters: checkpoints go through DCP (build the Guard after sharding).

    FSDP1 is refused: its flat shards are plain tensors, so their norm would be one
    rank's slice and its default state_dict a collective gather.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")  # (imported only if the program uses FSDP)
    fsdp1 = getattr(fsdp, "FullyShardedDataParallel", None)
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules()):
        raise ConfigError(
            "the Guard supports sharded models through FSDP2 "
            "(torch.distributed.fsdp.fully_shard) or DTensor parameters, not FSDP1's "
            "FullyShardedDataParallel: its flat shards give one rank's slice of the "
            "gradient norm; shard the model with fully_shard, then build the Guard"
        )
    return is_sharded([p for p in model.parameters()])


class ShardedState:
    """Model and optimizer of a sharded model, as one Stateful part."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        tensors: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        groups = None
        if self.optimizer.state:
            tensors["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        else:  # nothing to shard yet (see the module docstring)
            groups = copy.deepcopy(self.optimizer.state_dict()["param_groups"])
        return {DCP_KEY: tensors, "optimizer_groups": groups}

    def read_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with its DCP directory read into memory: collective (every rank reads its slices).

        The slices are read into copies, never into the live model: a read that fails on
        any rank (DCP raises on every rank then) leaves the model and the optimizer as they were.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        from torch.utils._pytree import tree_map_only

        tensors = state[DCP_KEY]
        if not isinstance(tensors, str):
            return state
        template: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if state.get("optimizer_groups") is None:
            # (an optimizer without state gets a zero-step one here, overwritten by the load)
            template["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        template = tree_map_only(torch.Tensor, lambda t: t.detach().clone(), template)
        dcp.load(template, checkpoint_id=tensors)
        return dict(state, **{DCP_KEY: template})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = self.read_state(state)  # (already in memory when the Guard read it first)
        tensors = state[DCP_KEY]
        groups = state.get("optimizer_groups")
        set_model_state_dict(self.model, tensors["model"])
        if groups is None:
            set_optimizer_state_dict(self.model, self.optimizer, tensors["optimizer"])
        else:
            self.optimizer.load_state_dict({"state": {}, "param_groups": groups})
        for p in self.model.parameters():  # the abandoned step's gradients are not restored state
            p.grad = None
