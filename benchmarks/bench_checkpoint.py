"""What a checkpoint costs inside the training step: synchronous ``torch.save`` vs async.

Two guards on two identical CPU models, interleaved round by round in one run
so that machine noise hits them alike:

- ``before`` (``GuardConfig(async_checkpoint=False)``): the step that
  checkpoints runs ``torch.save`` + fsync + rename + rotation itself;
- ``after`` (the default): the step copies the state to CPU memory and a
  background thread writes it (producers/async_checkpoint.py).

For each, the median time of ``guard.step`` in a step that checkpoints and in
one that does not (the latter also shows what the background write costs the
steps it overlaps on a shared CPU), and how often a save had to wait for the
previous write (``waits``: the interval is shorter than a write).

    python benchmarks/bench_checkpoint.py [--width 1024] [--every 20] [--rounds 6] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from torch import nn

from spikeguard.producers import Guard, GuardConfig


def make(seed: int, width: int, depth: int, batch: int = 32):
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    return model, opt, x, y


class Arm:
    def __init__(self, name: str, directory: str, width: int, depth: int, every: int, async_: bool):
        self.name = name
        self.model, self.opt, self.x, self.y = make(0, width, depth)
        cfg = GuardConfig(
            checkpoint_dir=directory,
            checkpoint_every=every,
            keep_checkpoints=2,
            resume=False,
            async_checkpoint=async_,
            skip_outliers=False,
        )
        self.guard = Guard(
            self.model, self.opt, run_id=f"bench-{name}", bus=None, connect=False, config=cfg
        )
        self.every = every
        self.ckpt: list[float] = []
        self.plain: list[float] = []

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(self.model(self.x), self.y)
            loss.backward()
            checkpoints = (self.guard.step_count + 1) % self.every == 0  # this step will save
            t0 = time.perf_counter()
            self.guard.step(loss)
            dt = time.perf_counter() - t0
            (self.ckpt if checkpoints else self.plain).append(dt)

    def summary(self) -> dict:
        return {
            "checkpoint_step_ms": 1e3 * statistics.median(self.ckpt),
            "plain_step_ms": 1e3 * statistics.median(self.plain),
            "plain_step_mean_ms": 1e3 * statistics.fmean(self.plain),
            "checkpoints": len(self.ckpt),
            "waits": self.guard.saver.waits,
            "wait_ms_total": 1e3 * self.guard.saver.wait_seconds,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--every", type=int, default=20, help="checkpoint interval in steps")
    ap.add_argument(
        "--rounds", type=int, default=6, help="interleaved rounds of 2 checkpoints per arm"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        arms = [
            Arm("before", a, args.width, args.depth, args.every, False),
            Arm("after", b, args.width, args.depth, args.every, True),
        ]
        for arm in arms:  # warm-up, and the first checkpoint at step 0
            arm.run(args.every)
            arm.ckpt.clear()
            arm.plain.clear()
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                arm.run(2 * args.every)
        for arm in arms:
            arm.guard.close()
        params = sum(p.numel() for p in arms[0].model.parameters())
        size = sum(p.stat().st_size for p in arms[0].guard.store.directory.glob("ckpt-*.pt"))
        size //= max(1, len(list(arms[0].guard.store.directory.glob("ckpt-*.pt"))))
    out = {
        "params": params,
        "checkpoint_bytes": size,
        "every": args.every,
        **{arm.name: arm.summary() for arm in arms},
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"model {params / 1e6:.1f} M params, checkpoint {size / 2**20:.0f} MiB, every {args.every} steps"
    )
    for arm in arms:
        s = arm.summary()
        print(
            f"{arm.name:>7}: step that checkpoints {s['checkpoint_step_ms']:8.1f} ms | other steps "
            f"{s['plain_step_ms']:6.1f} ms (mean {s['plain_step_mean_ms']:.1f}) | "
            f"{s['checkpoints']} checkpoints, {s['waits']} waited {s['wait_ms_total']:.0f} ms"
        )


if __name__ == "__main__":
    main()
