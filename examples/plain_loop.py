"""A plain PyTorch loop guarded by spikeguard: a small MLP learning characters.

    python examples/plain_loop.py --fault spike --json

The integration is three lines: ``Guard(...)``, ``guard.data(loader)`` in
place of the loader, ``guard.step(loss)`` in place of ``optimizer.step();
scheduler.step()``. ``--fault spike`` scales the inputs of three batches by
10^4 (a corrupted batch), ``--fault nan`` makes them NaN; faults live in the
data (by global batch index), so data the guard skips is gone for good. The
pipeline runs embedded (no Kafka), in lockstep (each step waits for its decision, so the
spike is caught at the same step every run; when a follow-up action such as
the learning rate's restore lands can still vary by a step, so the final loss
varies by ~0.05% between runs).
The last line printed with ``--json`` is one JSON object (final_eval_loss,
rollbacks, ...).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from spikeguard.producers import Guard, GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.settings import load_settings

from _shared import CONTEXT, SHORT_RUN, VOCAB, finish, windows

FAULT_BATCHES = range(100, 103)


def corrupt(kind: str, batch_index: int | None, x: torch.Tensor) -> torch.Tensor:
    if kind == "none" or batch_index not in FAULT_BATCHES:
        return x
    return x * 1e4 if kind == "spike" else x * math.nan


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=("none", "spike", "nan"), default="none")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    text = Path(argparse.__file__).read_text(encoding="utf-8")
    ids = torch.tensor([min(ord(c), VOCAB - 1) for c in text])
    split = int(len(ids) * 0.9)
    train, held_out = windows(ids[:split]), windows(ids[split:])
    loader = DataLoader(train, batch_size=64, shuffle=True)
    model = nn.Sequential(
        nn.Linear(CONTEXT * VOCAB, 96),
        nn.GELU(),
        nn.Linear(96, 96),
        nn.GELU(),
        nn.Linear(96, VOCAB),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=8e-3, total_steps=args.steps + 1, pct_start=0.1
    )

    runtime = open_runtime(load_settings(SHORT_RUN))  # the pipeline, embedded, in this process
    config = GuardConfig(
        checkpoint_dir=tempfile.mkdtemp(prefix="spikeguard-plain-"),
        checkpoint_every=20,
        keep_checkpoints=4,
        resume=False,
        lockstep=True,
        healthy_stretch=10,
        data_seed=args.seed,
    )
    guard = Guard(
        model,
        optimizer,
        scheduler,
        run_id=f"plain-{args.fault}-{args.seed}-{time.time_ns() % 10**9}",
        config=config,
        runtime=runtime,
        policy=runtime.settings.policy.model_dump(mode="json", exclude_defaults=True),
    )
    started = time.monotonic()
    try:
        data = guard.data(loader, max_steps=args.steps)
        while guard.step_count < args.steps and not guard.should_stop:
            for x, y in data:
                optimizer.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(
                    model(corrupt(args.fault, data.last_index, x)), y
                )
                loss.backward()
                guard.step(loss)
    finally:
        guard.close()
        runtime.close()
    model.eval()
    with torch.no_grad():
        x, y = held_out.tensors
        eval_loss = float(nn.functional.cross_entropy(model(x[:4096]), y[:4096]))
    result = {
        "example": "plain_loop",
        "fault": args.fault,
        "final_eval_loss": eval_loss,
        "rollbacks": guard.counters["rollbacks"],
        "steps": guard.step_count,
        "skipped_updates": guard.counters["skipped_updates"],
        "updates": guard.counters["updates"],
        "actions": sorted({a["kind"] for a in guard.applied if a["status"] == "applied"}),
        "seconds": round(time.monotonic() - started, 1),
    }
    return finish(result, args.json)


if __name__ == "__main__":
    main()
