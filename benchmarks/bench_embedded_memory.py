"""A long guarded run on the embedded pipeline: does the trainer's memory stay flat?

A tiny CPU model trained with ``Guard`` on the in-process pipeline (four
detectors, fusion, actuator as threads, as a user gets it by default). The
process's RSS is read at every ``--every`` steps (default 10k, 20k, 30k,
40k), with the records the bus holds in memory. Aim: RSS flat within 20 MiB
from step 10k to 40k (it grew ~11 KiB per step when the bus kept every record).
The model overfits one batch (a healthy run that converges to its noise floor):
the report ends with what the Guard did to it (``guard``: nothing, but a rare
outlier skip).

``--unbounded`` turns the bus's retention off, to show what it saves.

    python benchmarks/bench_embedded_memory.py [--steps 40000] [--every 10000] [--unbounded] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from typing import Any

import torch
from torch import nn

from spikeguard.bus import EmbeddedBus
from spikeguard.producers import Guard, GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.settings import load_settings


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def held(bus) -> int:
    with bus._cond:
        return sum(len(log) for topic in bus._topics.values() for log in topic.logs)


def held_by_topic(bus) -> dict[str, int]:
    """Records each topic holds: which one retention does not trim, when the total grows."""
    return {name: bus.retained(name) for name in list(bus._topics)}


def published(bus, topic: str) -> int:
    """Step events the guard has put on the bus so far (offsets are absolute: end offsets add up)."""
    return sum(bus.end_offset(topic, p) for p in range(bus.partitions))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40_000)
    parser.add_argument("--every", type=int, default=10_000)
    parser.add_argument(
        "--unbounded", action="store_true", help="no retention on the bus (the old behaviour)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        runtime = open_runtime(load_settings())
        if args.unbounded:
            bus = runtime.bus
            assert isinstance(bus, EmbeddedBus)  # the settings' default engine: in-process
            bus.keep_consumed = None
            bus.max_records = None
        # Checkpoints every 500 steps, keep 3: the default cadence would not change memory
        # either, but a long run with few files keeps the disk quiet.
        config = GuardConfig(checkpoint_dir=tmp, checkpoint_every=500, resume=False)
        guard = Guard(model, opt, run_id="memory", config=config, runtime=runtime)
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            opt.zero_grad(set_to_none=True)
            # A little noise in the data so the detectors see a live, not a constant, loss.
            loss = nn.functional.mse_loss(model(x + 0.01 * torch.randn_like(x)), y)
            loss.backward()
            guard.step(loss)
            if step % args.every == 0:
                gc.collect()
                samples.append(
                    {
                        "step": step,
                        "rss_mib": round(rss_mib(), 1),
                        "records_held": held(runtime.bus),
                        "held_by_topic": held_by_topic(runtime.bus),
                        "steps_published": published(runtime.bus, runtime.topics.steps),
                        "elapsed_s": round(time.perf_counter() - start, 1),
                    }
                )
                if not args.json:
                    print(samples[-1], flush=True)
        summary = guard.close()
        runtime.close()
    first, last = samples[0], samples[-1]
    growth = last["rss_mib"] - first["rss_mib"]
    per_step_kib = 1024 * growth / max(1, last["step"] - first["step"])
    report = {
        "retention": not args.unbounded,
        "samples": samples,
        "growth_mib": round(growth, 1),
        "growth_kib_per_step": round(per_step_kib, 3),
        "flat_within_20_mib": abs(growth) <= 20,
        # The run overfits one batch: a healthy run, which should cost nothing but the
        # Guard's own rare outlier skips; anything else here is a false action on it.
        "guard": {
            "incidents": summary.incidents,
            "actions": summary.actions,
            "withheld": summary.withheld,
            "notices": summary.notices,
            "updates_skipped": summary.updates_skipped,
        },
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"RSS {first['rss_mib']} MiB at step {first['step']} -> {last['rss_mib']} MiB at step "
            f"{last['step']}: {growth:+.1f} MiB ({per_step_kib:.2f} KiB/step); aim: within 20 MiB"
        )
        print(summary)


if __name__ == "__main__":
    main()
