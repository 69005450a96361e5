"""Closed-loop latency on a real broker: a step's publish -> its decision, and -> the action, at the trainer.

The workers of docs/kafka.md on a fresh topic prefix, in each ``--layout``:
``independent`` (six processes, one per component, the default in docs/design.md)
and ``cohosted`` (``worker detectors`` hosting the four detectors behind one
consumer, then fusion and actuator: three processes).
``--runs`` concurrent runs publish signed step events at ``--rate`` steps/s
in all (paced, round-robin over the runs, as many trainers would), each run
a simulated ``sudden_spike`` run so that the pipeline has incidents to act
on. A reader on the ``decisions`` and ``actions`` topics (what a trainer's
inbox reads) stamps each arrival; latency is arrival - publish of the step
the record is about (a decision's step; an action's evidence step).

Aim: p50 <= 20 ms, p99 <= 100 ms (publish -> action) at 1,000 steps/s over 100 runs.
When the pipeline's throughput (bench_kafka_throughput.py) is below the
input rate, the backlog grows for as long as the input lasts and latency
with it: the figures then say how far behind the pipeline fell, and
``lag_growth`` how fast.

    python benchmarks/bench_kafka_latency.py [--bootstrap HOST:PORT] [--rate 1000] [--runs 100] [--seconds 20]
        [--layout independent|cohosted|both] [--client kafka-python|confluent|both]
        [--worker-env NAME=VALUE ...] [--stage-clock DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer

from spikeguard.schemas import Action, Decision, StepVerdicts, Topics, Verdict, decode, encode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kafka_pipeline.py next to this file
from kafka_pipeline import LAYOUTS, broker, new_key, new_prefix, signed_steps, workers


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


class Reader(threading.Thread):
    """Stamps every decision and action as it arrives."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        super().__init__(daemon=True)
        self.topics = topics
        self.consumer = KafkaConsumer(
            topics.decisions,
            topics.actions,
            topics.verdicts,
            topics.step_verdicts,
            bootstrap_servers=bootstrap,
            group_id=f"bench-trainer-{uuid.uuid4().hex[:6]}",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            fetch_max_wait_ms=5,
        )
        self.decisions: list[tuple[str, int, float]] = []
        self.actions: list[tuple[str, int, float, str]] = []
        self.verdicts: list[
            tuple[str, int, float, str]
        ] = []  # where the time goes: the detectors' hop
        # Each record's CreateTime (set by its producer's send, wall clock, ms): splits the
        # latency into hops (step -> its last verdict produced -> decision produced -> read).
        self.created: dict[tuple[str, str, int], float] = {}
        self.stopping = threading.Event()
        self.arrived = 0  # decisions stamped so far (the drain loop waits on it)

    def run(self) -> None:
        # Stamped now, decoded after the run: decoding ~5,000 records/s here would take
        # CPU from the workers on a 2-core machine and lengthen what is measured.
        stamped: list[tuple[str, bytes, float, int]] = []
        while not self.stopping.is_set():
            for tp, batch in self.consumer.poll(timeout_ms=100, max_records=10_000).items():
                now = time.perf_counter()
                stamped += [(tp.topic, record.value, now, record.timestamp) for record in batch]
                if tp.topic == self.topics.decisions:
                    self.arrived += len(batch)
        self.consumer.close()
        for topic, value, now, created_ms in stamped:
            if topic == self.topics.decisions:
                d = decode(value, Decision)
                self.decisions.append((d.run_id, d.step, now))
                self.created[("decision", d.run_id, d.step)] = created_ms / 1000
            elif topic in (self.topics.verdicts, self.topics.step_verdicts):
                # One verdict per record (independent detectors), or a step's in one (co-hosted).
                packed = (
                    [decode(value, Verdict)]
                    if topic == self.topics.verdicts
                    else decode(value, StepVerdicts).verdicts
                )
                for v in packed:
                    self.verdicts.append((v.run_id, v.step, now, v.detector))
                    key = ("verdict", v.run_id, v.step)  # the step's last verdict to be produced
                    self.created[key] = max(self.created.get(key, 0.0), created_ms / 1000)
            else:
                a = decode(value, Action)
                step = a.evidence.step if a.evidence is not None else a.apply_at_step
                self.actions.append((a.run_id, step, now, a.kind.value))


def measure(
    bootstrap: str,
    rate: float,
    runs: int,
    seconds: float,
    drain_s: float,
    layout: str = "independent",
    client: str = "kafka-python",
    worker_env: dict[str, str] | None = None,
    stage_clock: str | None = None,
) -> dict:
    key, prefix = new_key(), new_prefix()
    topics = Topics(prefix)
    per_run = max(200, int(rate * seconds / runs))
    events = signed_steps(runs, per_run, key, scenario="sudden_spike")
    order = [(run[i].run_id, run[i].step, encode(run[i])) for i in range(per_run) for run in events]
    with workers(
        bootstrap,
        prefix,
        key,
        extra_env=worker_env,
        names=LAYOUTS[layout],
        client=client,
        stage_clock=stage_clock,
    ):
        reader = Reader(bootstrap, topics)
        reader.start()
        time.sleep(2.0)  # the reader joined its group
        producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=1)
        published: dict[tuple[str, int], float] = {}
        published_wall: dict[tuple[str, int], float] = {}
        start = time.perf_counter()
        for n, (run_id, step, value) in enumerate(order):
            due = start + n / rate
            wait = due - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            published[(run_id, step)] = time.perf_counter()
            published_wall[(run_id, step)] = time.time()
            producer.send(topics.steps, value, key=run_id.encode())
        producer.flush()
        input_s = time.perf_counter() - start
        deadline = time.monotonic() + drain_s
        while reader.arrived < len(order) and time.monotonic() < deadline:
            time.sleep(0.2)
        reader.stopping.set()
        reader.join(timeout=300)  # decodes what it stamped
        producer.close()
    to_decision = [t - published[(r, s)] for r, s, t in reader.decisions if (r, s) in published]
    to_action = [t - published[(r, s)] for r, s, t, _ in reader.actions if (r, s) in published]
    first_half = [
        t - published[(r, s)]
        for r, s, t in reader.decisions
        if (r, s) in published and published[(r, s)] - start < input_s / 2
    ]
    by_detector: dict[str, list[float]] = {}
    for r, s, t, detector in reader.verdicts:
        if (r, s) in published:
            by_detector.setdefault(detector, []).append(t - published[(r, s)])
    to_verdicts = [
        reader.created[("verdict", r, s)] - w
        for (r, s), w in published_wall.items()
        if ("verdict", r, s) in reader.created
    ]
    verdicts_to_decision = [
        reader.created[("decision", r, s)] - reader.created[("verdict", r, s)]
        for (r, s) in published_wall
        if ("decision", r, s) in reader.created and ("verdict", r, s) in reader.created
    ]
    kinds: dict[str, int] = {}
    for *_, kind in reader.actions:
        kinds[kind] = kinds.get(kind, 0) + 1
    return {
        "layout": layout,
        "client": client,
        "rate": rate,
        "runs": runs,
        "steps": len(order),
        "achieved_rate": round(len(order) / input_s),
        "decided": len(to_decision),
        "actions": len(to_action),
        "action_kinds": kinds,
        "decision_ms": {
            "p50": _pct(to_decision, 0.5),
            "p99": _pct(to_decision, 0.99),
            "max": _pct(to_decision, 1.0),
        },
        "action_ms": {
            "p50": _pct(to_action, 0.5),
            "p99": _pct(to_action, 0.99),
            "max": _pct(to_action, 1.0),
        },
        "verdict_p50_ms": {d: _pct(v, 0.5) for d, v in sorted(by_detector.items())},
        # By the records' CreateTime (1 ms resolution, same clock): step published -> its last
        # verdict sent by a detector; that verdict sent -> the decision sent by fusion.
        "hops_ms": {
            "step_to_last_verdict_sent": {
                "p50": _pct(to_verdicts, 0.5),
                "p99": _pct(to_verdicts, 0.99),
            },
            "last_verdict_to_decision_sent": {
                "p50": _pct(verdicts_to_decision, 0.5),
                "p99": _pct(verdicts_to_decision, 0.99),
            },
        },
        # Latency late vs early in the input: > 1 means a backlog that grows (throughput below the rate).
        "lag_growth": round(statistics.median(to_decision) / statistics.median(first_half), 2)
        if first_half and to_decision
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=os.environ.get("SPIKEGUARD_TEST_BOOTSTRAP"))
    parser.add_argument("--rate", type=float, default=1000.0, help="steps/s over all runs")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the input lasts")
    parser.add_argument(
        "--drain", type=float, default=90.0, help="seconds to wait for the last decisions"
    )
    parser.add_argument(
        "--layout",
        choices=[*LAYOUTS, "both"],
        default="both",
        help="independent: six worker processes; cohosted: `worker detectors` + fusion + actuator",
    )
    parser.add_argument(
        "--client",
        choices=["kafka-python", "confluent", "both"],
        default="kafka-python",
        help="the workers' Kafka library (settings.kafka_client); results keyed CLIENT/LAYOUT",
    )
    parser.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting for the workers, e.g. SPIKEGUARD_WORKER__MAX_UNACKED_RECORDS=0 "
        "(wait for acknowledgements after every batch) for an A/B; repeatable",
    )
    parser.add_argument(
        "--stage-clock",
        metavar="DIR",
        help="time each worker's stages (stage_clock.py: CPU and wall) into "
        "DIR/CLIENT-LAYOUT/NAME.STAGE.json; benchmarks/profile_stages.py reads them",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    worker_env = dict(item.split("=", 1) for item in args.worker_env)
    layouts = list(LAYOUTS) if args.layout == "both" else [args.layout]
    clients = ["kafka-python", "confluent"] if args.client == "both" else [args.client]
    with broker(args.bootstrap) as bootstrap:
        report = {
            f"{client}/{layout}": measure(
                bootstrap,
                args.rate,
                args.runs,
                args.seconds,
                args.drain,
                layout,
                client,
                worker_env,
                f"{args.stage_clock}/{client}-{layout}" if args.stage_clock else None,
            )
            for client in clients
            for layout in layouts
        }
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
