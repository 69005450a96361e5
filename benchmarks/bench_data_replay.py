"""What guard.data() costs when it has to reach a batch index: reading and dropping.

    python benchmarks/bench_data_replay.py [--batches 2000] [--batch-size 32] [--item-us 0] [--json out.json]

The wrapper never rebuilds the user's loader (data.py), so a resume or a
rollback to global batch ``g`` reads the epoch from its start through the
user's own iterator and drops the batches before ``g``; a skip range is
read and dropped too. This measures, for a map-style dataset of
``batches x batch-size`` items (each ``__getitem__`` optionally busy for
``--item-us`` microseconds, standing in for decoding/tokenising):

- ``step``: the time per batch of an uninterrupted pass (what training reads anyway);
- ``drop``: the time per dropped batch of a replay (its random streams saved and put back);
- ``rollback``: the time from ``seek`` to the batch, for a rollback to the epoch's middle and end.

A benchmark, not a test: it reports, it does not fail.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.data import DataLoader, Dataset

from spikeguard.producers.data import GuardedLoader


class Items(Dataset):
    def __init__(self, n: int, item_us: float) -> None:
        self.data = torch.randn(n, 64)
        self.item_s = item_us / 1e6

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.item_s:
            end = time.perf_counter() + self.item_s
            while time.perf_counter() < end:
                pass
        return self.data[i]


def measure(batches: int, batch_size: int, item_us: float) -> dict:
    torch.set_num_threads(1)
    loader = DataLoader(Items(batches * batch_size, item_us), batch_size=batch_size, shuffle=True)
    w = GuardedLoader(loader, seed=0, epochs=1)
    t0 = time.perf_counter()
    for _ in w:
        pass
    step = (time.perf_counter() - t0) / batches
    out = {
        "batches_per_epoch": batches,
        "batch_size": batch_size,
        "item_us": item_us,
        "step_ms": round(step * 1e3, 4),
    }
    for name, target in (("rollback_mid", batches // 2), ("rollback_end", batches - 1)):
        w = GuardedLoader(loader, seed=0, epochs=1)
        w.seek(target)
        t0 = time.perf_counter()
        next(iter(w))
        seconds = time.perf_counter() - t0
        out[f"{name}_s"] = round(seconds, 4)
        out["drop_ms"] = round((seconds - step) / max(1, w.dropped) * 1e3, 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--item-us", type=float, nargs="*", default=[0.0, 20.0])
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    rows = [measure(args.batches, args.batch_size, us) for us in args.item_us]
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
