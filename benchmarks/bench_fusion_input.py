"""Fusion's CPU per step for its two inputs: four Verdict records per step, or one StepVerdicts.

The same signed verdicts (the four detectors' judgement of simulated runs)
are published as bytes on the embedded bus, once one Verdict per record (what
independent detector workers send) and once one StepVerdicts record per step
(what ``worker detectors`` sends); a fusion Worker with the signing key then
decodes, authenticates and fuses them. The figure is the fusion worker's CPU
time per step (``time.process_time``, so a loaded machine changes it little),
the best of ``--rounds``, alternating the two inputs.

    python benchmarks/bench_fusion_input.py [--runs 40] [--steps 500] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import time

from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import DETECTOR_NAMES, build_stage, detector_stage
from spikeguard.lab.simulate import generate
from spikeguard.metrics import Metrics
from spikeguard.processors.cohosted_stage import CoHostedDetectors
from spikeguard.schemas import StepVerdicts, Topics, encode, sign_step
from spikeguard.schemas.signing import VERIFIED, sign
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

KEY = "bench-fusion-input-key-0123456789abcdef"
TOPICS = Topics("bench-fusion.")


def judged(runs: int, steps: int) -> list[StepVerdicts]:
    """Every step's verdicts, as the co-hosted detectors make them (interleaved across runs)."""
    settings = load_settings({"topic_prefix": TOPICS.prefix, "signing_key": KEY}, env={})
    stage = CoHostedDetectors([detector_stage(name, settings, TOPICS) for name in DETECTOR_NAMES])
    events = [
        generate("sudden_spike", max(200, steps), r, run_id=f"bench-{r:03d}").events[:steps]
        for r in range(runs)
    ]
    interleaved = [sign_step(run[i], KEY) for i in range(steps) for run in events]
    out: list[StepVerdicts] = []
    for start in range(0, len(interleaved), 400):
        for _, e in stage.handle_batch(
            [(TOPICS.steps, s) for s in interleaved[start : start + 400]]
        ):
            assert isinstance(e, StepVerdicts)  # main() reads each as one: a step's verdicts
            out.append(e)
    return out


def fusion_cpu(records: list[tuple[str, bytes, str]], steps: int) -> float:
    """Fusion's CPU microseconds per step over ``records`` (topic, value, key)."""
    settings = load_settings({"topic_prefix": TOPICS.prefix, "signing_key": KEY}, env={})
    bus = EmbeddedBus(partitions=4)
    producer = bus.producer()
    for topic, value, key in records:
        producer.publish(topic, value, key=key)
    worker = Worker(
        bus,
        build_stage("fusion", settings, TOPICS),
        metrics=Metrics(CollectorRegistry()),
        snapshots=False,
        max_records=500,
    )
    VERIFIED.clear()  # every record is checked in full, as in a process of its own
    started = time.process_time()
    while worker.run_once(timeout=0):
        pass
    return 1e6 * (time.process_time() - started) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--steps", type=int, default=500, help="steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    packed = judged(args.runs, args.steps)
    apart = [(TOPICS.verdicts, encode(sign(v, KEY)), v.run_id) for p in packed for v in p.verdicts]
    together = [(TOPICS.step_verdicts, encode(sign(p, KEY)), p.run_id) for p in packed]
    steps = len(packed)
    results: dict[str, list[float]] = {"four_verdict_records": [], "one_step_verdicts_record": []}
    for _ in range(args.rounds):
        results["four_verdict_records"].append(fusion_cpu(apart, steps))
        results["one_step_verdicts_record"].append(fusion_cpu(together, steps))
    best = {name: round(min(values), 1) for name, values in results.items()}
    out = {
        "steps": steps,
        "cpu_us_per_step": best,
        "rounds_us": {name: [round(v, 1) for v in values] for name, values in results.items()},
    }
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
