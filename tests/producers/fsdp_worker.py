"""One rank of the two-process FSDP2 test (spawned by test_fsdp.py): gloo, CPU, fixed seeds."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from spikeguard.bus import EmbeddedBus
from spikeguard.producers import Guard, GuardConfig, checkpoint_id
from spikeguard.schemas import Action, ActionKind, StepEvent, Topics, decode, encode

STEPS = 20


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(256, 6)
    y = x @ torch.randn(6, 1)
    ds = TensorDataset(x, y)
    loader = DataLoader(
        ds, batch_size=8, sampler=DistributedSampler(ds, num_replicas=world, rank=rank)
    )
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin = copy.deepcopy(model)  # the same model, never sharded: the reference for the norm
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    bus = EmbeddedBus()  # each rank publishes its steps to its own; only rank 0 reads actions
    if rank == 0:
        for a in (
            Action(
                action_id="f-1",
                run_id="fs",
                kind=ActionKind.ROLLBACK,
                apply_at_step=14,
                decision_id="d",
                params={"target_step": 10, "checkpoint_id": checkpoint_id("fs", 10, 0)},
            ),
            Action(
                action_id="f-2",
                run_id="fs",
                kind=ActionKind.SKIP_BATCHES,
                apply_at_step=14,
                decision_id="d",
                params={"from_step": 10, "to_step": 13, "extra": 1},
            ),
        ):
            bus.producer().publish(Topics().actions, encode(a), key="fs")
    guard = Guard(
        model,
        opt,
        run_id="fs",
        bus=bus,
        connect=False,
        config=GuardConfig(
            checkpoint_dir=str(Path(out_dir) / "ckpt"),
            checkpoint_every=5,
            resume=False,
            publish_all_ranks=True,
            update_norm=True,
        ),
    )
    if rank == 0:  # deterministic: both actions are in the inbox before training starts
        deadline = time.monotonic() + 10
        while guard.inbox._handed < 2 and time.monotonic() < deadline:
            time.sleep(0.002)
    sums = _count_sum_all_reduces()
    reference, outcomes, reduces, shards, updates = {}, [], {}, {}, {}
    data = guard.data(loader, max_steps=STEPS)
    while guard.step_count < STEPS:
        for xb, yb in data:
            epoch, step = guard.generation, guard.step_count
            if step == 10 and (epoch, step) not in shards:  # the state the checkpoint at 10 holds
                shards[(epoch, step)] = _local_state(model, opt)
            if rank == 1 and (epoch, step) == (0, 7):
                xb = xb * float("nan")  # only rank 1 sees a bad batch
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            reference[f"{epoch}/{step}"] = _unsharded_norm(model, twin, xb, yb)
            before = [p.full_tensor() for p in model.parameters()]
            sums.clear()
            outcomes.append([epoch, step, guard.step(loss)])
            reduces[f"{epoch}/{step}"] = len(sums)
            after = [p.full_tensor() for p in model.parameters()]
            updates[f"{epoch}/{step}"] = float(
                torch.linalg.vector_norm(
                    torch.stack([(b - a).norm() for a, b in zip(after, before)])
                )
            )
    guard.close(finished=False)  # as if the job died here: the next one resumes
    final = _local_state(model, opt)
    resumed = _resume(out_dir)
    events = [decode(r.value, StepEvent) for r in bus.read_all(Topics().steps)]
    published = {f"{e.epoch}/{e.step}": e.grad_norm for e in events}
    published_updates = {f"{e.epoch}/{e.step}": e.update_norm for e in events}
    before, after = shards[(0, 10)], shards[(1, 10)]
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "published": published,
                "reference": reference,
                "published_updates": published_updates,
                "reference_updates": updates,
                "outcomes": outcomes,
                "reduces": reduces,
                "restored": [torch.equal(a, b) for a, b in zip(before, after)],
                "n_shards": len(before),
                "shard_rows": [t.shape[0] for t in before],
                "skip_ranges": data.skip_ranges,
                "epoch": guard.generation,
                "rollbacks": guard.counters["rollbacks"],
                "skipped": guard.counters["skipped_updates"],
                "resumed_at": [resumed[0].resumed_from.epoch, resumed[0].resumed_from.step],
                "resumed_equal": [torch.equal(a, b) for a, b in zip(final, resumed[1])],
            }
        )
    )
    dist.destroy_process_group()


def _resume(out_dir: str):
    """A new process's Guard on a freshly built (differently initialised) sharded model."""
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for module in (model[0], model[2], model):
        fully_shard(module)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = Guard(
        model,
        opt,
        run_id="fs",
        connect=False,
        config=GuardConfig(checkpoint_dir=str(Path(out_dir) / "ckpt"), checkpoint_every=5),
    )
    state = _local_state(model, opt)
    guard.close(finished=False)
    return guard, state


def _count_sum_all_reduces() -> list:
    """Every SUM all-reduce from now on, by wrapping the real collective (it still runs)."""
    real = dist.all_reduce

    class Calls(list):
        pass

    calls = Calls()
    calls.real = real  # (to put the real one back)

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.SUM:
            calls.append(tuple(tensor.shape))
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    return calls


def _local_state(model, opt) -> list[torch.Tensor]:
    """This rank's slices of the parameters and of Adam's moments (copies)."""
    out = [p.detach().to_local().clone() for p in model.parameters()]
    for p in model.parameters():
        state = opt.state.get(p, {})
        out += [state[k].to_local().clone() for k in ("exp_avg", "exp_avg_sq") if k in state]
    return out


def _unsharded_norm(model, twin, xb, yb) -> float:
    """The gradient norm of the unsharded twin with the same weights on both ranks' batches
    (FSDP averages the ranks' gradients: the mean loss over their union)."""
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin.parameters()):
            q.copy_(p.full_tensor())
    xs, ys = [torch.empty_like(xb) for _ in range(2)], [torch.empty_like(yb) for _ in range(2)]
    dist.all_gather(xs, xb)
    dist.all_gather(ys, yb)
    twin.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(twin(torch.cat(xs)), torch.cat(ys)).backward()
    return float(torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in twin.parameters()])))
