"""How long one loop cycle of the co-hosted detectors takes on a real broker, the state saves included.

A step waits at the detectors for the cycle it arrives in: the slowest
cycles are the pipeline's p99. ``--runs`` simulated runs of ``--steps``
steps (signed) are published first; then ``worker detectors`` (the four
detectors behind one consumer, state saved every ``--interval`` seconds) runs
in this process, ``--batch`` records per poll, and each ``run_once`` is timed
on the wall clock and on the process's CPU clock. Reported: cycles per
second, and the p50 / p99 / max of a cycle, wall and CPU, over the cycles
that read records; and each periodic save (``Worker.checkpoint`` as the loop
calls it) on the wall clock: how many, p50, max and their total.

    python benchmarks/bench_kafka_save_stall.py [--bootstrap HOST:PORT] [--runs 100] [--steps 200]
        [--batch 100] [--interval 2.0] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from spikeguard.bus.kafka import KafkaBus
from spikeguard.components import DETECTOR_NAMES, detector_stage
from spikeguard.metrics import Metrics
from spikeguard.processors.cohosted_stage import CoHostedDetectors
from spikeguard.schemas import Topics, encode
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kafka_pipeline.py next to this file
from kafka_pipeline import broker, new_key, new_prefix, signed_steps


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def measure(bootstrap: str, runs: int, steps: int, batch: int, interval: float) -> dict:
    key, prefix = new_key(), new_prefix()
    topics = Topics(prefix)
    settings = load_settings({"topic_prefix": prefix, "signing_key": key}, env={})
    bus = KafkaBus(bootstrap)
    bus.create_topics([topics.steps])
    producer = bus.producer()
    per_run = signed_steps(runs, steps, key)
    for i in range(steps):
        for run in per_run:
            producer.publish(topics.steps, encode(run[i]), key=run[i].run_id)
    producer.flush()
    stage = CoHostedDetectors([detector_stage(name, settings, topics) for name in DETECTOR_NAMES])
    worker = Worker(
        bus,
        stage,
        metrics=Metrics(CollectorRegistry()),
        max_records=batch,
        snapshot_interval_s=interval,
    )
    wall: list[float] = []
    cpu: list[float] = []
    saves: list[float] = []  # each checkpoint inside a cycle (the loop's own call), wall time
    checkpoint = worker.checkpoint

    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        w = time.perf_counter()
        checkpoint(*args, **kwargs)
        saves.append(time.perf_counter() - w)

    worker.checkpoint = timed  # type: ignore[method-assign]
    done, total, idle = 0, runs * steps, 0
    started = time.perf_counter()
    while done < total and idle < 50:
        w, c = time.perf_counter(), time.process_time()
        got = worker.run_once(timeout=0.5)
        if got:
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
            done += got
            idle = 0
        else:
            idle += 1
    elapsed = time.perf_counter() - started
    worker.checkpoint = checkpoint  # type: ignore[method-assign]
    worker.close()
    bus.close()
    return {
        "runs": runs,
        "steps": total,
        "consumed": done,
        "cycles": len(wall),
        "steps_per_s": round(done / elapsed),
        "interval_s": interval,
        "cycle_wall_ms": {"p50": _pct(wall, 0.5), "p99": _pct(wall, 0.99), "max": _pct(wall, 1.0)},
        "cycle_cpu_ms": {"p50": _pct(cpu, 0.5), "p99": _pct(cpu, 0.99), "max": _pct(cpu, 1.0)},
        "saves": len(saves),
        "save_wall_ms": {
            "p50": _pct(saves, 0.5),
            "max": _pct(saves, 1.0),
            "total": round(1000 * sum(saves)),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=os.environ.get("SPIKEGUARD_TEST_BOOTSTRAP"))
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with broker(args.bootstrap) as bootstrap:
        out = measure(bootstrap, args.runs, args.steps, args.batch, args.interval)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
