"""One rank of the two-process gloo tests (spawned by test_distributed.py)."""

from __future__ import annotations

import faulthandler
import json
import os
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from spikeguard.bus import EmbeddedBus
from spikeguard.producers import Guard, GuardConfig, checkpoint_id
from spikeguard.schemas import Ack, Action, ActionKind, Topics, decode, encode

OUTLIER_AT = 20  # the outlier run: rank 1 alone gets a bad batch at this step


def run(rank: int, world: int, port: int, out_dir: str, outlier_at: int | None = None) -> None:
    """One rank; what made it fail (an exception, a fatal signal) is left in ``rank{N}.err``.

    torch.multiprocessing reports one rank's error; when one rank dies, the other's
    "connection closed by peer" can be the one reported, so each rank keeps its own.
    """
    err = Path(out_dir, f"rank{rank}.err")
    with err.open("w") as fault_file:
        faulthandler.enable(file=fault_file)  # a crash in C (a signal) leaves its stack too
        try:
            _run(rank, world, port, out_dir, outlier_at)
        except BaseException:
            fault_file.write(traceback.format_exc())
            raise
        finally:
            faulthandler.disable()


def run_all(
    rank: int, world: int, port: int, out_dir: str, more_ports: list[int], scenarios: list[str]
) -> None:
    """Every two-rank run of test_distributed.py in this one process per rank, each on a process
    group of its own and writing into a folder of its own under ``out_dir``: the actions run
    (``actions/``), the outlier run (``outlier/``), then the disagreement scenarios
    (``disagree/``, disagreement_worker.py). A rank's start-up (torch's import above all) costs
    more CPU than any of its runs."""
    import disagreement_worker

    parts: list[tuple[str, int, Callable[[str, int], None]]] = [
        ("actions", port, lambda where, p: run(rank, world, p, where)),
        ("outlier", more_ports[0], lambda where, p: run(rank, world, p, where, OUTLIER_AT)),
        (
            "disagree",
            more_ports[1],
            lambda where, p: disagreement_worker.run(rank, world, p, where, scenarios),
        ),
    ]
    with Path(out_dir, f"rank{rank}.err").open("w") as fault_file:
        try:
            for name, part_port, part in parts:
                where = Path(out_dir, name)
                where.mkdir(exist_ok=True)
                part(str(where), part_port)
        except BaseException:
            fault_file.write(traceback.format_exc())
            raise


def _run(rank: int, world: int, port: int, out_dir: str, outlier_at: int | None) -> None:
    """``outlier_at``: rank 1 alone gets a bad (finite) batch at that step, and no actions are sent."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(256, 6)
    y = x @ torch.randn(6, 1)
    sampler = DistributedSampler(TensorDataset(x, y), num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, sampler=sampler)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    bus = None
    if outlier_at is not None:
        return _outlier_run(rank, model, opt, loader, out_dir, outlier_at)
    if rank == 0:  # only rank 0 talks to the bus; the other rank gets actions by broadcast
        bus = EmbeddedBus()
        acts = [
            Action(
                action_id="a-1",
                run_id="dd",
                kind=ActionKind.SCALE_LR,
                apply_at_step=3,
                params={"factor": 0.5},
            ),
            Action(
                action_id="a-2",
                run_id="dd",
                kind=ActionKind.CLIP,
                apply_at_step=5,
                params={"max_norm": 0.5},
            ),
            Action(
                action_id="a-3",
                run_id="dd",
                kind=ActionKind.ROLLBACK,
                apply_at_step=14,
                decision_id="d",
                params={"target_step": 10, "checkpoint_id": checkpoint_id("dd", 10, 0)},
            ),
            Action(
                action_id="a-4",
                run_id="dd",
                kind=ActionKind.SKIP_BATCHES,
                apply_at_step=14,
                decision_id="d",
                params={"from_step": 10, "to_step": 13, "extra": 1},
            ),
        ]
        for a in acts:
            bus.producer().publish(Topics().actions, encode(a), key="dd")
    guard = Guard(
        model,
        opt,
        run_id="dd",
        bus=bus,
        connect=False,
        config=GuardConfig(
            checkpoint_dir=str(Path(out_dir) / "ckpt"), checkpoint_every=5, resume=False
        ),
    )
    if rank == 0:  # make the test deterministic: the actions are in the inbox before training
        import time

        deadline = time.monotonic() + 10
        while guard.inbox._handed < 4 and time.monotonic() < deadline:
            time.sleep(0.002)
    poisoned = False
    data = guard.data(loader, max_steps=20)
    while guard.step_count < 20:
        for xb, yb in data:
            if rank == 1 and guard.step_count == 7 and not poisoned:
                xb = xb * float("nan")  # only one rank sees a bad batch
                poisoned = True
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            guard.step(loss)
    guard.close()
    result = {
        "applied": [(a["step"], a["epoch"], a["kind"], a["status"]) for a in guard.applied],
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "epoch": guard.generation,
        "skipped": guard.counters["skipped_updates"],
        "last_index": data.last_index,
        "skip_ranges": data.skip_ranges,
    }
    if bus is not None:
        result["acks"] = [decode(r.value, Ack).status.value for r in bus.read_all(Topics().acks)]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _outlier_run(rank, model, opt, loader, out_dir, outlier_at) -> None:
    guard = Guard(
        model,
        opt,
        run_id="dd",
        connect=False,
        config=GuardConfig(
            checkpoint_dir=str(Path(out_dir) / "ckpt"), checkpoint_every=0, resume=False
        ),
    )
    outcomes = []
    for xb, yb in guard.data(loader, epochs=2, max_steps=30):
        if rank == 1 and guard.step_count == outlier_at:
            yb = yb + 50.0  # only one rank sees it; its loss alone jumps
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        outcomes.append(guard.step(loss))
    guard.close()
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "outcomes": outcomes,
                "outlier_skips": guard.counters["outlier_skips"],
                "params": [p.detach().flatten().tolist() for p in model.parameters()],
            }
        )
    )
    dist.destroy_process_group()
