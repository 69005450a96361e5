"""Memory per run, and in all, for 10,000 concurrent runs through each worker kind.

Each kind is measured in a process of its own (so one kind's RSS is not
another's): its inputs are made by the real upstream stages on the embedded
bus (steps -> the four detectors -> fusion -> the actuator, plus two checkpoint
events per run), the upstream workers are dropped, and then one worker of the
kind drains every input. Two figures per kind:

- ``bytes_per_run``: what the worker holds for its runs after ``--runs`` runs of
  ``--steps`` steps (a deep ``sys.getsizeof`` walk of the stage and the
  worker's per-run maps, see spikeguard/streaming/footprint.py), with
  ``total_mib`` for all of them and the process's RSS growth while it ran;
- ``steady_bytes_per_run``: the same walk after ``--sample-runs`` runs of
  ``--sample-steps`` steps, long enough that a run's state stops growing
  (detector history full, the ML forest fitted), and ``steady_10k_mib``: that
  times 10,000 runs, against the aim of 1 GiB per worker.

The embedded bus keeps every record in memory, so the RSS figure is an upper
bound; the deep size is the worker's own share. Snapshots are off (a Kafka
worker's state store holds only the set of runs changed since its last save).

    python benchmarks/bench_scale_runs.py [--runs 10000] [--steps 10] [--kinds statistical,fusion]
        [--sample-runs 8] [--sample-steps 1300] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import time

from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import COMPONENTS, DETECTOR_NAMES, build_stage
from spikeguard.metrics import Metrics
from spikeguard.schemas import CheckpointEvent, StepEvent, Topics
from spikeguard.settings import load_settings
from spikeguard.streaming.footprint import deep_size
from spikeguard.streaming.stage import PerRunStage
from spikeguard.streaming.worker import Worker

TOPICS = Topics("bench.")
AIM_BYTES = 2**30


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def feed(bus: EmbeddedBus, runs: int, steps: int, seed: int) -> None:
    """``runs`` concurrent runs: step 0 of every run, then step 1 of every run, ..."""
    rngs = [random.Random(seed * 1_000_003 + i) for i in range(runs)]
    producer = bus.producer()
    for step in range(steps):
        events = []
        for i, rng in enumerate(rngs):
            loss = 2.5 * (0.999**step) + rng.gauss(0, 0.02)
            if step and step % 97 == i % 97:  # now and then a spike, so fusion and policy act
                loss *= 3
            events.append(
                (
                    TOPICS.steps,
                    StepEvent(
                        run_id=f"run-{i:05d}",
                        step=step,
                        loss=loss,
                        grad_norm=1.0 + rng.gauss(0, 0.05),
                        lr=1e-3,
                        time=0.0,
                    ),
                )
            )
        producer.publish_events(events)
    for step in (0, steps // 2):
        producer.publish_events(
            (
                TOPICS.checkpoints,
                CheckpointEvent(
                    run_id=f"run-{i:05d}", step=step, checkpoint_id=f"c{i}-{step}", healthy=True
                ),
            )
            for i in range(runs)
        )


def worker_for(bus: EmbeddedBus, name: str, settings) -> Worker:  # type: ignore[no-untyped-def]
    return Worker(
        bus,
        build_stage(name, settings, TOPICS),
        metrics=Metrics(CollectorRegistry()),
        snapshots=False,
        max_records=5000,
    )


def drain(worker: Worker) -> None:
    while worker.run_once(timeout=0):
        pass
    worker.drain()  # what is still pending (fusion's undecided steps) goes out


def held(worker: Worker) -> int:
    return deep_size(worker.stage, worker._run_partition)


def measure(kind: str, runs: int, steps: int, seed: int) -> dict:
    settings = load_settings({"topic_prefix": TOPICS.prefix}, env={})
    bus = EmbeddedBus(partitions=4)
    feed(bus, runs, steps, seed)
    upstream = (
        []
        if kind in DETECTOR_NAMES
        else list(DETECTOR_NAMES) + (["fusion"] if kind == "actuator" else [])
    )
    for name in upstream:
        worker = worker_for(bus, name, settings)
        drain(worker)
        del worker
    gc.collect()
    rss_before = rss_bytes()
    worker = worker_for(bus, kind, settings)
    empty = held(worker)
    started = time.perf_counter()
    drain(worker)
    seconds = time.perf_counter() - started
    gc.collect()
    total = held(worker) - empty
    stage = worker.stage
    assert isinstance(stage, PerRunStage)  # every component's stage holds one object per run
    return {
        "kind": kind,
        "runs": runs,
        "steps_per_run": steps,
        "runs_in_memory": len(stage.runs),
        "bytes_per_run": round(total / runs),
        "total_mib": round(total / 2**20, 1),
        "rss_growth_mib": round((rss_bytes() - rss_before) / 2**20, 1),
        "rss_mib": round(rss_bytes() / 2**20, 1),
        "seconds": round(seconds, 1),
    }


def one(kind: str, args: argparse.Namespace) -> dict:
    row = measure(kind, args.runs, args.steps, args.seed)
    steady = measure(kind, args.sample_runs, args.sample_steps, args.seed)
    row["steady_bytes_per_run"] = steady["bytes_per_run"]
    row["steady_steps"] = args.sample_steps
    row["steady_10k_mib"] = round(steady["bytes_per_run"] * 10_000 / 2**20, 1)
    row["aim_met"] = steady["bytes_per_run"] * 10_000 <= AIM_BYTES
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=10, help="steps per run in the 10k-run load")
    parser.add_argument("--sample-runs", type=int, default=8)
    parser.add_argument(
        "--sample-steps",
        type=int,
        default=1300,
        help="steps per run for the steady-state size (past ML's warm-up and refits)",
    )
    parser.add_argument("--kinds", default=",".join(COMPONENTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one kind
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one, args)))
        return 0
    rows = []
    for kind in args.kinds.split(","):
        child = [
            sys.executable,
            __file__,
            "--one",
            kind,
            "--runs",
            str(args.runs),
            "--steps",
            str(args.steps),
            "--sample-runs",
            str(args.sample_runs),
            "--sample-steps",
            str(args.sample_steps),
            "--seed",
            str(args.seed),
        ]
        done = subprocess.run(child, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if not args.json:
            r = rows[-1]
            print(
                f"{r['kind']:<12} {r['runs']:>6} runs x {r['steps_per_run']} steps: "
                f"{r['bytes_per_run']:>8,} B/run, {r['total_mib']:>7.1f} MiB held, RSS +"
                f"{r['rss_growth_mib']:.0f} MiB ({r['rss_mib']:.0f} MiB), {r['seconds']:.1f}s | "
                f"steady ({r['steady_steps']} steps) {r['steady_bytes_per_run']:>9,} B/run -> "
                f"{r['steady_10k_mib']:>8.1f} MiB for 10k runs, aim {'met' if r['aim_met'] else 'MISSED'}",
                flush=True,
            )
    if args.json:
        print(json.dumps({"aim_bytes_per_worker": AIM_BYTES, "kinds": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
