"""One rank of the ranks-in-disagreement scenarios (spawned by test_distributed.py).

Every scenario runs on a process group of its own with a short timeout, so a
scenario that leaves the ranks in different collectives fails as an error in
its own result instead of hanging the others. Each scenario writes
``rank{N}-{scenario}.json``: what the ranks did, and a hash of the parameters
and the optimizer state at the end (the full tensors under FSDP2).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import time
import traceback
import zipfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from spikeguard.bus import EmbeddedBus
from spikeguard.producers import Guard, GuardConfig, checkpoint_id
from spikeguard.producers.actions import ActionFailed
from spikeguard.schemas import Ack, Action, ActionKind, StepEvent, Topics, decode, encode

GROUP_TIMEOUT = timedelta(seconds=15)  # a scenario whose ranks split fails within this
WORLD_TIMEOUT = timedelta(seconds=60)  # between scenarios: longer than a failing scenario's wait
SIGNAL_WAIT = 10.0  # the longest a rank waits for the other's signal file


def run(rank: int, world: int, port: int, out_dir: str, scenarios: list[str]) -> None:
    err = Path(out_dir, f"rank{rank}.err")
    with err.open("w") as fault_file:
        faulthandler.enable(file=fault_file)
        try:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=WORLD_TIMEOUT)
            torch.set_num_threads(1)
            for name in scenarios:
                dist.barrier()  # (a rank whose scenario failed first waits here for the other)
                group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
                where = Path(out_dir, name)
                where.mkdir(exist_ok=True)
                try:
                    result = SCENARIOS[name](rank, group, where)
                except Exception:  # noqa: BLE001 - the scenario failed: its result says how
                    result = {"error": traceback.format_exc()[-3000:]}
                Path(out_dir, f"rank{rank}-{name}.json").write_text(json.dumps(result))
            dist.destroy_process_group()
        except BaseException:
            fault_file.write(traceback.format_exc())
            raise
        finally:
            faulthandler.disable()


# -- shared pieces -------------------------------------------------------------
def _data(rank: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=g)
    y = x @ torch.randn(6, 1, generator=g)
    ds = TensorDataset(x, y)
    return DataLoader(
        ds, batch_size=8, sampler=DistributedSampler(ds, num_replicas=2, rank=rank, seed=0)
    )


def _ddp(group: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)),
        process_group=group,
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _fsdp(group: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    mesh = DeviceMesh.from_group(group, "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _guard(model, opt, group, where: Path, bus=None, **config) -> Guard:
    config = {"checkpoint_every": 5, "resume": False, **config}
    return Guard(
        model,
        opt,
        run_id=where.name,
        bus=bus,
        connect=False,
        process_group=group,
        config=GuardConfig(checkpoint_dir=str(where / "ckpt"), **config),
    )


def _train(
    guard: Guard,
    model,
    opt,
    data,
    until: int,
    corrupt: Callable[[int, torch.Tensor, torch.Tensor], tuple] | None = None,
    losses: dict | None = None,
) -> None:
    """Train until the guard's step counter reaches ``until``."""
    while guard.step_count < until:
        for xb, yb in data:
            if corrupt is not None:
                xb, yb = corrupt(guard.step_count, xb, yb)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            if losses is not None:
                losses[f"{guard.generation}/{guard.step_count}"] = loss.item()
            guard.step(loss)
            if guard.step_count >= until:
                break


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def state_hash(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of every parameter and every optimizer state value (whole tensors, collective under FSDP2)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(_full(p.detach()).contiguous().numpy().tobytes())
        for key in sorted(opt.state.get(p, {})):
            value = opt.state[p][key]
            if isinstance(value, torch.Tensor):
                h.update(_full(value.detach()).contiguous().numpy().tobytes())
            else:
                h.update(repr(value).encode())
    return h.hexdigest()


def _rollback(guard: Guard, target: int, cid: str | None = None) -> str:
    try:
        return guard.rollback(target, cid)
    except ActionFailed as exc:
        return f"FAILED: {exc}"


def _end(guard: Guard, model, opt, **extra) -> dict:
    guard.close(finished=False)
    return {
        "hash": state_hash(model, opt),
        "step": guard.step_count,
        "epoch": guard.generation,
        "checkpoints": guard.counters["checkpoints"],
        "rollbacks": guard.counters["rollbacks"],
        **extra,
    }


def _wait_for(*paths: Path) -> None:
    deadline = time.monotonic() + SIGNAL_WAIT
    while not any(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.001)


# -- the scenarios ---------------------------------------------------------------
def race(rank: int, group: Any, where: Path) -> dict:
    """``guard.rollback(10)`` right after the periodic save at 10 was queued, rank 0's disk slow:
    its write starts only once rank 1 is inside the rollback."""
    model, opt = _ddp(group)
    guard = _guard(model, opt, group, where)
    inside = where / "rank1-inside-rollback"
    armed = False
    if rank == 0:
        save = guard.store.save

        def slow_save(payload, *, step, epoch, healthy):
            if step == 10:
                _wait_for(inside)
            return save(payload, step=step, epoch=epoch, healthy=healthy)

        guard.store.save = slow_save
    else:
        wait = guard.saver.wait

        def signalling_wait():
            wait()
            if armed:
                inside.touch()

        guard.saver.wait = signalling_wait
    data = guard.data(_data(rank), epochs=5)
    _train(guard, model, opt, data, 10)
    armed = True
    text = _rollback(guard, 10)
    landed = guard.step_count
    _train(guard, model, opt, data, 16)
    return _end(guard, model, opt, rollback=text, landed=landed)


def read_error(rank: int, group: Any, where: Path, sharded: bool = False) -> dict:
    """A ROLLBACK action to step 10; rank 1's first checkpoint read in it fails with an I/O error."""
    model, opt = (_fsdp if sharded else _ddp)(group)
    bus = None
    if rank == 0:
        bus = EmbeddedBus()
        bus.producer().publish(
            Topics().actions,
            encode(
                Action(
                    action_id="r-1",
                    run_id=where.name,
                    kind=ActionKind.ROLLBACK,
                    apply_at_step=12,
                    decision_id="d",
                    params={"target_step": 10, "checkpoint_id": checkpoint_id(where.name, 10, 0)},
                )
            ),
            key=where.name,
        )
    guard = _guard(model, opt, group, where, bus=bus)
    if rank == 0:
        deadline = time.monotonic() + SIGNAL_WAIT
        while guard.inbox._handed < 1 and time.monotonic() < deadline:
            time.sleep(0.002)
    failures = []
    if rank == 1:
        real_load = torch.load

        def flaky_load(*args, **kwargs):
            if guard.step_count == 12 and not failures:
                failures.append(str(args[0]))
                raise OSError(5, "Input/output error (injected)")
            return real_load(*args, **kwargs)

        torch.load = flaky_load
    try:
        data = guard.data(_data(rank), epochs=5)
        _train(guard, model, opt, data, 20)
    finally:
        if rank == 1:
            torch.load = real_load
    acks = [decode(r.value, Ack) for r in bus.read_all(Topics().acks)] if bus is not None else []
    return _end(
        guard,
        model,
        opt,
        injected=failures,
        applied=[
            (a["step"], a["epoch"], a["kind"], a["status"], a["result"]) for a in guard.applied
        ],
        acks=[(a.status.value, a.result) for a in acks],
    )


def fsdp_read_error(rank: int, group: Any, where: Path) -> dict:
    return read_error(rank, group, where, sharded=True)


SPIKE = range(40, 46)  # the steps whose batches are corrupted, on rank 1 only


def spike(rank: int, group: Any, where: Path) -> dict:
    """Rank 1's batches of steps 40..45 only are corrupted x1000; rank 0 publishes the steps."""
    model, opt = _ddp(group)
    bus = EmbeddedBus() if rank == 0 else None
    guard = _guard(model, opt, group, where, bus=bus)

    def corrupt(step, xb, yb):
        return (xb, yb * 1000.0) if rank == 1 and step in SPIKE else (xb, yb)

    losses: dict = {}
    _train(guard, model, opt, guard.data(_data(rank), epochs=5), 56, corrupt, losses)
    events = []
    if bus is not None:
        guard.publisher.flush(5.0)
        events = [
            decode(r.value, StepEvent).model_dump(mode="json") for r in bus.read_all(Topics().steps)
        ]
    return _end(guard, model, opt, losses=losses, events=events)


def late(rank: int, group: Any, where: Path) -> dict:
    """Rank 1 reaches its first batch once rank 0's step-0 checkpoint is on disk (or rank 0
    waits for it in a collective); the ranks' random streams differ (their own seeds)."""
    model, opt = _ddp(group)
    guard = _guard(model, opt, group, where, async_checkpoint=False)
    torch.manual_seed(1000 + rank)
    waiting = where / "rank0-in-collective"
    if rank == 0:
        real = dist.broadcast_object_list

        def signalling(*args, **kwargs):
            waiting.touch()
            return real(*args, **kwargs)

        dist.broadcast_object_list = signalling
    else:
        deadline = time.monotonic() + SIGNAL_WAIT
        while (not waiting.exists() and not guard.store.list(0)) and time.monotonic() < deadline:
            time.sleep(0.001)
    data = guard.data(_data(rank), epochs=5)
    try:
        _train(guard, model, opt, data, 12)
    finally:
        if rank == 0:
            dist.broadcast_object_list = real
    ids = {r: sorted(c.checkpoint_id for c in guard.store.list(r)) for r in (0, 1)}
    counted = guard.counters["checkpoints"]
    text = _rollback(guard, 0)
    rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    _train(guard, model, opt, data, 4)
    return _end(guard, model, opt, ids=ids, counted=counted, rollback=text, rng=rng)


def truncated(rank: int, group: Any, where: Path) -> dict:
    """Checkpoints at 5, 10, 15 kept; 15's file truncated, a byte of a tensor in 10's flipped:
    a rollback falls back to 5, on both ranks."""
    model, opt = _ddp(group)
    guard = _guard(model, opt, group, where, keep_checkpoints=3, async_checkpoint=False)
    data = guard.data(_data(rank), epochs=5)
    _train(guard, model, opt, data, 16)
    kept = sorted(c.step for c in guard.store.list(0))
    dist.barrier(group=group)
    if rank == 0:
        newest, older = guard.store.list(0)[:2]
        raw = newest.path.read_bytes()
        newest.path.write_bytes(raw[: len(raw) // 2])
        _flip_a_tensor_byte(older.path)
    dist.barrier(group=group)
    text = _rollback(guard, 16)
    landed = guard.step_count
    _train(guard, model, opt, data, 20)
    return _end(guard, model, opt, kept=kept, rollback=text, landed=landed)


def _flip_a_tensor_byte(path: Path) -> None:
    """Change one byte inside the largest tensor's data (the zip's structure stays intact)."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


# -- issue 37, rows 9-11: an exception on one rank, or a budget weighed per rank ------------------
def _rollback_action(run_id: str, decision_id: str | None = "d") -> EmbeddedBus:
    """Rank 0's bus, holding a ROLLBACK to step 10 due at step 12 (and, with a decision, its skip
    window due at step 30: a part of the plan only rank 0 holds until then)."""
    bus = EmbeddedBus()
    actions = [
        Action(
            action_id="r-1",
            run_id=run_id,
            kind=ActionKind.ROLLBACK,
            apply_at_step=12,
            decision_id=decision_id,
            params={"target_step": 10, "checkpoint_id": checkpoint_id(run_id, 10, 0)},
        )
    ]
    if decision_id is not None:
        actions.append(
            Action(
                action_id="s-1",
                run_id=run_id,
                kind=ActionKind.SKIP_BATCHES,
                apply_at_step=30,
                decision_id=decision_id,
                params={"from_step": 11, "to_step": 12, "extra": 20},
            )
        )
    for action in actions:
        bus.producer().publish(Topics().actions, encode(action), key=run_id)
    return bus


def _faulty_rollback(
    rank: int,
    group: Any,
    where: Path,
    fault: Callable[[int, Guard], list],
    sharded: bool = False,
    epochs: tuple[int, int] = (5, 5),
    **config: Any,
) -> dict:
    """The ROLLBACK of ``_rollback_action`` with ``fault(rank, guard)`` installed; every rank's
    outcome, acks and state."""
    model, opt = (_fsdp if sharded else _ddp)(group)
    bus = _rollback_action(where.name) if rank == 0 else None
    guard = _guard(model, opt, group, where, bus=bus, async_checkpoint=False, **config)
    if rank == 0:
        deadline = time.monotonic() + SIGNAL_WAIT
        while guard.inbox._handed < 2 and time.monotonic() < deadline:
            time.sleep(0.002)
    injected = fault(rank, guard)
    _train(guard, model, opt, guard.data(_data(rank), epochs=epochs[rank]), 14)
    acks = [decode(r.value, Ack) for r in bus.read_all(Topics().acks)] if bus is not None else []
    return _end(
        guard,
        model,
        opt,
        injected=injected,
        applied=[
            (a["step"], a["epoch"], a["kind"], a["status"], a["result"]) for a in guard.applied
        ],
        acks=[(a.status.value, a.result) for a in acks],
    )


def _once_at_step_12(guard: Guard, name: str, on: Any = None) -> list:
    """The first call of ``on.name`` (the guard's store by default) at step 12 raises an OSError."""
    on = guard.store if on is None else on
    real, injected = getattr(on, name), []

    def failing(*args: Any, **kwargs: Any) -> Any:
        if guard.step_count == 12 and not injected:
            injected.append(name)
            raise OSError(5, f"Input/output error (injected in {name})")
        return real(*args, **kwargs)

    setattr(on, name, failing)
    return injected


def list_error_rank0(rank: int, group: Any, where: Path) -> dict:
    """Row 9: listing the checkpoint directory fails once on rank 0 in the rollback's step."""
    return _faulty_rollback(
        rank, group, where, lambda r, g: _once_at_step_12(g, "list") if r == 0 else []
    )


def list_error_rank1(rank: int, group: Any, where: Path) -> dict:
    """Row 9: listing the checkpoint directory fails once on rank 1 in the rollback's step."""
    return _faulty_rollback(
        rank, group, where, lambda r, g: _once_at_step_12(g, "list") if r == 1 else []
    )


def load_error(rank: int, group: Any, where: Path, sharded: bool = False) -> dict:
    """Row 10: a store read error on rank 1 outside torch.load (``store.load`` raises OSError)."""
    return _faulty_rollback(
        rank,
        group,
        where,
        lambda r, g: _once_at_step_12(g, "load") if r == 1 else [],
        sharded=sharded,
    )


def fsdp_load_error(rank: int, group: Any, where: Path) -> dict:
    return load_error(rank, group, where, sharded=True)


BUDGET = {"recovery_min_steps": 0, "max_rerun_share": 0.1, "max_skip_share": 1.0}


def budget_lengths(rank: int, group: Any, where: Path) -> dict:
    """Row 11: the ranks' loaders differ in length (5 passes on rank 0, 1 on rank 1): the
    2-step re-run fits rank 0's budget (8 steps of 80), not rank 1's (1 of 16)."""
    return _faulty_rollback(rank, group, where, lambda r, g: [], epochs=(5, 1), **BUDGET)


def budget_pending(rank: int, group: Any, where: Path) -> dict:
    """Row 11: the rollback's skip window, due later, is only in rank 0's pending actions: the
    plan whole is over the skip budget (22 of 8 allowed), the rollback alone is not."""
    return _faulty_rollback(
        rank,
        group,
        where,
        lambda r, g: [],
        **{**BUDGET, "max_rerun_share": 1.0, "max_skip_share": 0.1},
    )


SCENARIOS: dict[str, Callable[[int, Any, Path], dict]] = {
    "race": race,
    "read_error": read_error,
    "spike": spike,
    "late": late,
    "truncated": truncated,
    "fsdp_read_error": fsdp_read_error,
    "list_error_rank0": list_error_rank0,
    "list_error_rank1": list_error_rank1,
    "load_error": load_error,
    "fsdp_load_error": fsdp_load_error,
    "budget_lengths": budget_lengths,
    "budget_pending": budget_pending,
}
