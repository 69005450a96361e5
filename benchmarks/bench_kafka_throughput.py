"""Pipeline throughput on a real broker, next to a raw kafka-python loop on the same broker, same run.

- ``pipeline``: the workers of docs/kafka.md in each ``--layout``: ``independent``,
  six processes (``spikeguard worker NAME`` each, the default), and
  ``cohosted``, three (``worker detectors`` hosting the four detectors behind
  one consumer, ``worker fusion``, ``worker actuator``). ``--steps`` signed step events of ``--runs`` simulated runs
  are published as fast as the producer goes; the rate is decisions out of
  fusion per second between the 10th and the 90th percentile of their
  arrival (the steady state: the pipeline's sustained rate, what it keeps up
  with at bounded lag; faster input only grows the lag).
- ``--client``: which library the workers speak Kafka with (``kafka_client``:
  ``kafka-python``, ``confluent`` for confluent-kafka on librdkafka, or
  ``both``, one after the other on the same broker); pipelines are reported
  as ``CLIENT/LAYOUT``.
- ``raw``: the same records through a bare kafka-python consumer -> producer
  loop (poll, send each to another topic, flush, commit), the ceiling a
  Python worker on this client and machine can reach; the reference of every
  ratio, whatever the client. ``raw_confluent`` (when confluent runs): the
  same loop on confluent-kafka, that client's ceiling; ``raw_confluent_step-verdicts``
  and ``raw_confluent_decisions``: the same loop on the records of the later two hops
  (as the work floor makes them), the client's CPU per record of each hop in the limit.

Aim: pipeline >= 10,000 steps/s and >= 0.5x raw.

    python benchmarks/bench_kafka_throughput.py [--bootstrap HOST:PORT] [--steps 20000] [--runs 100]
        [--layout independent|cohosted|both] [--client kafka-python|confluent|both] [--profile DIR]
        [--worker-env NAME=VALUE ...] [--cprofile DIR] [--stage-clock DIR] [--json]

Within one run every pipeline and the raw loop share the broker and the
machine: the ratios are the figures to compare across runs.

Without ``--bootstrap`` (or ``SPIKEGUARD_TEST_BOOTSTRAP``) a local broker is
started with scripts/kafka_local.sh and stopped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer

from spikeguard.bus import Bus, Record
from spikeguard.bus.base import Consumer, Producer, as_key
from spikeguard.bus.kafka import KafkaBus
from spikeguard.schemas import Topics, encode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # kafka_pipeline.py next to this file
from kafka_pipeline import LAYOUTS, broker, new_key, signed_steps, new_prefix, worker_name, workers


def _values(runs: int, steps: int, key: str) -> list[tuple[bytes, bytes]]:
    """(key, value) of every step, interleaved across runs as concurrent trainers would publish."""
    per_run = signed_steps(runs, steps // runs, key)
    return [
        (run[i].run_id.encode(), encode(run[i])) for i in range(steps // runs) for run in per_run
    ]


def _steady_rate(arrivals: list[float]) -> float:
    """Decisions per second between the 10th and the 90th percentile of their arrival."""
    arrivals = sorted(arrivals)
    lo, hi = arrivals[len(arrivals) // 10], arrivals[(9 * len(arrivals)) // 10]
    if hi - lo < 0.5:  # too few polls in between to time a steady state: the whole span
        return len(arrivals) / max(arrivals[-1], 1e-9)
    return (len(arrivals) * 0.8) / (hi - lo)


def pipeline(
    bootstrap: str,
    records: list[tuple[bytes, bytes]],
    key: str,
    timeout: float,
    profile: str | None = None,
    layout: str = "independent",
    client: str = "kafka-python",
    worker_env: dict[str, str] | None = None,
    cprofile: str | None = None,
    stage_clock: str | None = None,
) -> dict:
    prefix = new_prefix()
    topics = Topics(prefix)
    with workers(
        bootstrap,
        prefix,
        key,
        extra_env=worker_env,
        names=LAYOUTS[layout],
        client=client,
        cprofile=cprofile,
        stage_clock=stage_clock,
    ) as procs:
        spies = profile_workers(procs, profile, seconds=timeout) if profile else []
        reader = KafkaConsumer(
            topics.decisions,
            bootstrap_servers=bootstrap,
            group_id=f"bench-{uuid.uuid4().hex[:6]}",
            auto_offset_reset="earliest",
            enable_auto_commit=False,
        )
        reader.poll(timeout_ms=2000)  # join before the first decision
        producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, batch_size=256 * 1024)
        cpu_before = {
            f"{worker_name(proc)}#{n}": _cpu_seconds(proc.pid) for n, proc in enumerate(procs)
        }
        started = time.perf_counter()
        for k, v in records:
            producer.send(topics.steps, v, key=k)
        producer.flush()
        published = time.perf_counter() - started
        arrivals: list[float] = []
        deadline = time.monotonic() + timeout
        while len(arrivals) < len(records) and time.monotonic() < deadline:
            for batch in reader.poll(timeout_ms=500, max_records=10_000).values():
                now = time.perf_counter() - started
                arrivals += [now] * len(batch)
        cpu = {
            name: _cpu_seconds(proc.pid) - cpu_before[f"{name}#{n}"]
            for n, proc in enumerate(procs)
            for name in [worker_name(proc)]
        }
        reader.close()
        producer.close()
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled so far
            spy.wait(timeout=30)
    return {
        "published_per_s": round(len(records) / published),
        "decisions": len(arrivals),
        "steps": len(records),
        "end_to_end_s": round(arrivals[-1], 2) if arrivals else None,
        # Only a run that decided every step has a sustained rate to report.
        "steps_per_s": round(_steady_rate(arrivals)) if len(arrivals) == len(records) else 0,
        "overall_per_s": round(len(arrivals) / arrivals[-1]) if arrivals else 0,
        # CPU the workers spent per step (user + system, from /proc): unlike the rates,
        # it hardly moves with what else runs on a shared machine.
        "cpu_us_per_step": {
            name: round(1e6 * seconds / len(records)) for name, seconds in cpu.items()
        },
        "cpu_us_per_step_total": round(1e6 * sum(cpu.values()) / len(records)),
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def profile_workers(procs: list, directory: str, seconds: float) -> list[subprocess.Popen]:
    """py-spy (``pip install py-spy``) sampling each worker into DIRECTORY/NAME.raw (collapsed stacks)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    spies = []
    for proc in procs:
        name = worker_name(proc)
        spies.append(
            subprocess.Popen(
                [
                    _py_spy(),
                    "record",
                    "--pid",
                    str(proc.pid),
                    "--rate",
                    "100",
                    "--format",
                    "raw",
                    "--duration",
                    str(int(seconds)),
                    "--output",
                    f"{directory}/{name}.raw",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    time.sleep(1.0)  # attached before the first step is published
    return spies


def _py_spy() -> str:
    """py-spy on the PATH, else the one installed next to this interpreter (an unactivated venv)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else "py-spy")


def raw(bootstrap: str, records: list[tuple[bytes, bytes]], timeout: float) -> dict:
    source, sink = f"raw-{uuid.uuid4().hex[:8]}", f"raw-{uuid.uuid4().hex[:8]}"
    KafkaBus(bootstrap, partitions=4).create_topics([source, sink])
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, batch_size=256 * 1024)
    for k, v in records:
        producer.send(source, v, key=k)
    producer.flush()
    consumer = KafkaConsumer(
        source,
        bootstrap_servers=bootstrap,
        group_id=f"raw-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    done, started, cpu_started = 0, None, 0.0
    deadline = time.monotonic() + timeout
    while done < len(records) and time.monotonic() < deadline:
        batches = consumer.poll(timeout_ms=1000, max_records=500)
        if not batches:
            continue
        if started is None:
            started, cpu_started = time.perf_counter(), time.process_time()
        for batch in batches.values():
            for record in batch:
                producer.send(sink, record.value, key=record.key)
            done += len(batch)
        producer.flush()
        consumer.commit()
    elapsed = time.perf_counter() - (started or time.perf_counter())
    cpu = time.process_time() - cpu_started if started is not None else 0.0
    consumer.close()
    producer.close()
    return {
        "steps": done,
        "steps_per_s": round(done / elapsed) if elapsed else 0,
        # This process (the loop and kafka-python's threads): one consume + one produce per record.
        "cpu_us_per_step": round(1e6 * cpu / done) if done else None,
    }


def raw_confluent(bootstrap: str, records: list[tuple[bytes, bytes]], timeout: float) -> dict:
    """:func:`raw` on confluent-kafka: poll one, take what is ready, produce each, flush, commit."""
    import confluent_kafka as ck

    source, sink = f"raw-{uuid.uuid4().hex[:8]}", f"raw-{uuid.uuid4().hex[:8]}"
    KafkaBus(bootstrap, partitions=4).create_topics([source, sink])
    producer = ck.Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 5, "partitioner": "murmur2_random"}
    )
    for k, v in records:
        producer.produce(source, v, k)
        producer.poll(0)
    producer.flush()
    consumer = ck.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"raw-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([source])
    done, started, cpu_started = 0, None, 0.0
    deadline = time.monotonic() + timeout
    while done < len(records) and time.monotonic() < deadline:
        first = consumer.poll(1.0)
        if first is None:
            continue
        if started is None:
            started, cpu_started = time.perf_counter(), time.process_time()
        batch = [first, *consumer.consume(499, 0)]
        for m in batch:
            if m.error() is None:
                producer.produce(sink, m.value(), m.key())
                done += 1
        producer.flush()
        consumer.commit(asynchronous=False)
    elapsed = time.perf_counter() - (started or time.perf_counter())
    cpu = time.process_time() - cpu_started if started is not None else 0.0
    consumer.close()
    return {
        "steps": done,
        "steps_per_s": round(done / elapsed) if elapsed else 0,
        "cpu_us_per_step": round(1e6 * cpu / done) if done else None,
        "cpu_us_per_record": round(1e6 * cpu / done, 2) if done else None,
    }


def work_floor(
    records: list[tuple[bytes, bytes]],
    key: str,
    batch: int = 500,
    wire: dict[str, list[tuple[bytes, bytes]]] | None = None,
) -> dict:
    """CPU µs per step of the work the co-hosted workers cannot skip, in one process, no broker.

    On the same signed records: decode each step and check its signature; admit it (the
    stage's order, session and run-clock checks) and judge it (the co-hosted detectors' stage,
    then fusion's, then the actuator's policy, batch by batch, as the workers call them);
    sign, encode, decode and check each step's StepVerdicts record and each decision (what
    crosses the two hops after the first). Add the bare client's CPU per record at each of the
    three hops and this is the least CPU per step a signed pipeline of these stages spends:
    ``limit`` turns it into the most steps/s this machine's cores allow. ``without`` names the
    rows an older floor left out (the actuator's judging and every hop's admission), so that
    the floor as first measured can be read beside it. ``wire``, when given, receives each
    later hop's records as they travel (key, value): what the client is timed on per hop.
    """
    import gc

    from spikeguard.components import DETECTOR_NAMES, build_stage, detector_stage
    from spikeguard.lab.backtest import offline
    from spikeguard.processors.cohosted_stage import CoHostedDetectors
    from spikeguard.schemas import Decision, StepEvent, StepVerdicts, decode
    from spikeguard.schemas.signing import sign, signature_problem
    from spikeguard.settings import load_settings

    settings = offline(load_settings(env={}))  # no keys on the stages: signing is timed apart
    topics = Topics(settings.topic_prefix)
    detectors = CoHostedDetectors([detector_stage(n, settings, topics) for n in DETECTOR_NAMES])
    fusion = build_stage("fusion", settings, topics)
    actuator = build_stage("actuator", settings, topics)
    spent: dict[str, float] = {}

    def timed(name: str, work):
        started = time.process_time()
        out = work()
        spent[name] = spent.get(name, 0.0) + time.process_time() - started
        return out

    def hop(name: str, model: type, events: list) -> list:
        """Sign, encode, decode and check ``events``: one hop of the pipeline's records."""
        signed = timed(f"sign {name}", lambda: [sign(e, key) for e in events])
        data = timed(f"codec {name}", lambda: [encode(e) for e in signed])
        if wire is not None:
            wire[name] = [(e.run_id.encode(), value) for e, value in zip(signed, data)]
        back = timed(f"codec {name}", lambda: [decode(d, model) for d in data])
        problems = timed(f"check {name}", lambda: [signature_problem(e, key) for e in back])
        assert not any(problems), problems[:1]
        return back

    gc.disable()
    steps = timed("codec steps", lambda: [decode(value, StepEvent) for _, value in records])
    problems = timed("check steps", lambda: [signature_problem(e, key) for e in steps])
    assert not any(problems), problems[:1]

    def judged(name: str, stage, topic: str, events: list) -> list:
        """``events`` admitted and judged by ``stage``, batch by batch, as its worker does."""
        out: list = []
        for i in range(0, len(events), batch):
            items = [(topic, e) for e in events[i : i + batch]]
            timed(f"admit {name}", lambda items=items: [stage.admit(*item) for item in items])
            out += timed(f"judge {name}", lambda items=items: stage.handle_batch(items))
        return out

    verdicts = judged("detectors", detectors, topics.steps, steps)
    step_verdicts = hop("step-verdicts", StepVerdicts, [e for _, e in verdicts])
    decisions = judged("fusion", fusion, topics.step_verdicts, step_verdicts)
    decisions += timed("judge fusion", fusion.flush)
    back = hop("decisions", Decision, [e for _, e in decisions])
    judged("actuator", actuator, topics.decisions, back)
    gc.enable()
    n = len(records)
    return {
        "steps": n,
        "decisions": len(decisions),
        "cpu_us_per_step": {name: round(1e6 * s / n, 1) for name, s in spent.items()},
        "cpu_us_per_step_total": round(1e6 * sum(spent.values()) / n, 1),
        # The detectors' process: its input's decoding and check, its judging, its output.
        "detectors_process_us": round(
            1e6
            * sum(
                s
                for name, s in spent.items()
                if name
                in (
                    "codec steps",
                    "check steps",
                    "admit detectors",
                    "judge detectors",
                    "sign step-verdicts",
                )
            )
            / n,
            1,
        ),
        # The rows a floor measured before 2026-12-07 did not have.
        "without": ["admit detectors", "admit fusion", "admit actuator", "judge actuator"],
    }


class _Wire(Bus):
    """Topics as lists of records in this process, carrying the bytes Kafka would: the workers'
    own code (poll, decode, admit, judge, sign, encode, publish, commit) with no client."""

    engine = "wire"

    def __init__(self) -> None:
        self.logs: dict[str, list[Record]] = {}

    def producer(self) -> _WireProducer:
        return _WireProducer(self.logs)

    def consumer(self, group, topics, *, from_beginning=True, on_assign=None, on_revoke=None):  # type: ignore[no-untyped-def]
        return _WireConsumer(self.logs, list(topics), on_assign)

    def create_topics(self, topics, *, compacted=False) -> None:  # type: ignore[no-untyped-def]
        for topic in topics:
            self.logs.setdefault(topic, [])

    def read_all(self, topic: str, timeout: float = 10.0) -> list[Record]:
        return []

    def delete_records(self, topic, before) -> None:  # type: ignore[no-untyped-def]
        pass


class _WireProducer(Producer):
    def __init__(self, logs: dict[str, list[Record]]) -> None:
        self.logs = logs

    def publish(self, topic, value, key=None, headers=None) -> None:  # type: ignore[no-untyped-def]
        log = self.logs.setdefault(topic, [])
        log.append(Record(topic, 0, len(log), as_key(key), value))

    def flush(self, timeout: float | None = None) -> None:
        pass

    def send_now(self) -> None:
        pass


class _WireConsumer(Consumer):
    def __init__(self, logs: dict[str, list[Record]], topics: list[str], on_assign) -> None:  # type: ignore[no-untyped-def]
        self.logs, self.topics, self.on_assign = logs, topics, on_assign
        self.position = dict.fromkeys(topics, 0)

    def poll(self, max_records: int = 500, timeout: float = 1.0) -> list[Record]:
        if self.on_assign is not None:  # the first poll joins the group, as Kafka's does
            assign, self.on_assign = self.on_assign, None
            assign(self.assignment())
        out: list[Record] = []
        for topic in self.topics:
            at = self.position[topic]
            taken = self.logs.get(topic, [])[at : at + max_records - len(out)]
            self.position[topic] = at + len(taken)
            out += taken
        return out

    def commit(self, offsets=None) -> None:  # type: ignore[no-untyped-def]
        pass

    def assignment(self) -> set[tuple[str, int]]:
        return {(topic, 0) for topic in self.topics}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        self.position[topic] = offset


def wire_pipeline(records: list[tuple[bytes, bytes]], key: str) -> dict:
    """CPU µs per step of the three co-hosted workers' own loops on the wire's bytes, no client.

    Each worker (as ``spikeguard worker NAME`` builds it: signing key, snapshots every
    2 s) runs until its input is drained, one after the other, in this process. Against the
    work floor it shows what the workers' loops add; against the pipeline on the broker,
    what the client and the machine add.
    """
    import gc

    from prometheus_client import CollectorRegistry

    from spikeguard.components import build_stage
    from spikeguard.metrics import Metrics
    from spikeguard.settings import load_settings
    from spikeguard.streaming.worker import Worker

    settings = load_settings(env={"SPIKEGUARD_SIGNING_KEY": key})
    topics = Topics(settings.topic_prefix)
    wire = _Wire()
    log = wire.logs.setdefault(topics.steps, [])
    for k, value in records:
        log.append(Record(topics.steps, 0, len(log), k, value))
    spent: dict[str, float] = {}
    metrics = Metrics(CollectorRegistry())  # one per process, as each worker's
    threshold = gc.get_threshold()
    for name in ("detectors", "fusion", "actuator"):
        worker = Worker(
            wire, build_stage(name, settings, topics), metrics=metrics, snapshot_interval_s=2.0
        )
        gc.collect()
        gc.freeze()  # as `spikeguard worker` runs its workers
        gc.set_threshold(50_000, 20, 100)
        started = time.process_time()
        while worker.run_once(0.0):
            pass
        worker.checkpoint()
        spent[name] = time.process_time() - started
        gc.set_threshold(*threshold)
        gc.unfreeze()
    n = len(records)
    return {
        "decisions": len(wire.logs.get(topics.decisions, [])),
        "cpu_us_per_step": {name: round(1e6 * s / n, 1) for name, s in spent.items()},
        "cpu_us_per_step_total": round(1e6 * sum(spent.values()) / n, 1),
    }


def mean_floor(floors: list[dict]) -> dict:
    """The floors' mean, row by row; ``each``: every floor's total, to show their spread."""
    first = floors[0]
    rows = {
        name: round(sum(f["cpu_us_per_step"][name] for f in floors) / len(floors), 1)
        for name in first["cpu_us_per_step"]
    }
    mean = {
        name: round(sum(f[name] for f in floors) / len(floors), 1)
        for name in ("cpu_us_per_step_total", "detectors_process_us")
    }
    return {
        **first,
        "cpu_us_per_step": rows,
        **mean,
        "each": [f["cpu_us_per_step_total"] for f in floors],
    }


def limit(
    floor: dict, client_us: float, cores: int, client_by_hop: dict[str, float] | None = None
) -> dict:
    """The most steps/s the work floor allows: all cores busy with nothing else, and no faster
    than the co-hosted detectors' process alone (one process, one core at most).

    The client's own CPU: a record consumed and one produced at each of the three hops, at
    ``client_us`` each (the bare loop's on step records), or at ``client_by_hop``'s (the bare
    loop's on each hop's own records: a step's verdicts are ~3x a step's bytes).
    """
    rows = floor["cpu_us_per_step"]
    as_before = (
        floor["cpu_us_per_step_total"]
        - sum(rows.get(name, 0.0) for name in floor.get("without", ()))
        + 3 * client_us
    )
    if client_by_hop:
        client_total = sum(client_by_hop.values())
        busiest = (
            floor["detectors_process_us"]
            + (client_by_hop["steps"] + client_by_hop["step-verdicts"]) / 2
        )  # the detectors' process reads a step and writes its verdicts
    else:
        client_total, busiest = 3 * client_us, floor["detectors_process_us"] + client_us
    total = floor["cpu_us_per_step_total"] + client_total
    return {
        "floor_us_per_step": round(total, 1),
        # As the floor was first measured: without the rows it gained on 2026-12-07, and the
        # client at the step records' cost at every hop (comparable with earlier figures).
        "floor_us_per_step_as_before": round(as_before, 1),
        "client_us_per_step": round(client_total, 2),
        "cores": cores,
        "steps_per_s": round(min(cores * 1e6 / total, 1e6 / busiest)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=os.environ.get("SPIKEGUARD_TEST_BOOTSTRAP"))
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument(
        "--timeout",
        type=float,
        default=100.0,
        help="seconds the pipeline gets to decide every step",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="py-spy each worker during the pipeline run into DIR"
    )
    parser.add_argument(
        "--cprofile",
        metavar="DIR",
        help="cProfile each worker's loop (CPU clock) into DIR/CLIENT-LAYOUT/NAME.prof; "
        "benchmarks/profile_stages.py reads them",
    )
    parser.add_argument(
        "--stage-clock",
        metavar="DIR",
        help="time each worker's stages (stage_clock.py, CPU clock) into "
        "DIR/CLIENT-LAYOUT/NAME.STAGE.json",
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
        default="both",
        help="the workers' Kafka library (settings.kafka_client); the raw reference stays kafka-python",
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
        "--no-floor",
        action="store_true",
        help="skip the in-process work floor (the limit the pipeline is read against)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    worker_env = dict(item.split("=", 1) for item in args.worker_env)
    key = new_key()
    records = _values(args.runs, args.steps, key)
    layouts = list(LAYOUTS) if args.layout == "both" else [args.layout]
    clients = ["kafka-python", "confluent"] if args.client == "both" else [args.client]
    with broker(args.bootstrap) as bootstrap:
        raw_result = raw(bootstrap, records, args.timeout)
        extra = (
            {"raw_confluent": raw_confluent(bootstrap, records, args.timeout)}
            if "confluent" in clients
            else {}
        )
        # The floor just before the pipelines and just after (its mean is the one read): on a
        # shared machine CPU per step moves by a third within minutes, so the pipeline is read
        # against a floor measured around it, not minutes apart.
        floors = [] if args.no_floor else [work_floor(records, key)]
        pipes = {
            f"{client}/{layout}": pipeline(
                bootstrap,
                records,
                key,
                args.timeout,
                f"{args.profile}/{client}-{layout}" if args.profile else None,
                layout,
                client,
                worker_env,
                f"{args.cprofile}/{client}-{layout}" if args.cprofile else None,
                f"{args.stage_clock}/{client}-{layout}" if args.stage_clock else None,
            )
            for client in clients
            for layout in layouts
        }
        if not args.no_floor:
            wire: dict[str, list[tuple[bytes, bytes]]] = {}
            floors.append(work_floor(records, key, wire=wire))
            floor = mean_floor(floors)
            bare = extra.get("raw_confluent", raw_result)
            by_hop = None
            if "raw_confluent" in extra:  # the bare client on each later hop's own records
                by_hop = {"steps": bare["cpu_us_per_record"]}
                for hop, values in wire.items():
                    extra[f"raw_confluent_{hop}"] = raw_confluent(bootstrap, values, args.timeout)
                    by_hop[hop] = extra[f"raw_confluent_{hop}"]["cpu_us_per_record"]
            extra["work_floor"] = floor
            extra["wire"] = wire_pipeline(records, key)
            extra["wire"]["over_floor"] = round(
                extra["wire"]["cpu_us_per_step_total"] / floor["cpu_us_per_step_total"], 3
            )
            extra["limit"] = limit(
                floor, bare["cpu_us_per_step"], len(os.sched_getaffinity(0)), by_hop
            )
    report = {
        "steps": len(records),
        "runs": args.runs,
        "raw": raw_result,
        **extra,
        "pipelines": {
            name: {
                **result,
                "ratio": round(result["steps_per_s"] / max(1, raw_result["steps_per_s"]), 3),
            }
            for name, result in pipes.items()
        },
    }
    if "limit" in extra:
        cap = extra["limit"]
        for result in report["pipelines"].values():
            result["of_limit"] = round(result["steps_per_s"] / max(1, cap["steps_per_s"]), 3)
            # The steadier reading on a shared machine: the workers' CPU per step over the floor's.
            result["cpu_over_floor"] = round(
                result["cpu_us_per_step_total"] / cap["floor_us_per_step"], 3
            )
            result["cpu_over_floor_as_before"] = round(
                result["cpu_us_per_step_total"] / cap["floor_us_per_step_as_before"], 3
            )
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"raw kafka-python loop: {raw_result['steps_per_s']:>7,} steps/s, "
        f"{raw_result['cpu_us_per_step']} us CPU per record"
    )
    for name in [n for n in extra if n.startswith("raw_confluent")]:
        print(
            f"raw confluent-kafka loop{name[len('raw_confluent') :].replace('_', ', ')}: "
            f"{extra[name]['steps_per_s']:>7,} records/s, "
            f"{extra[name]['cpu_us_per_record']} us CPU per record"
        )
    for name, result in report["pipelines"].items():
        layout = name.split("/")[1]
        print(
            f"pipeline {name:<24} ({len(LAYOUTS[layout])} workers): {result['steps_per_s']:>7,} steps/s "
            f"sustained, ratio {result['ratio']:.2f}; {result['decisions']}/{len(records)} decided, "
            f"last after {result['end_to_end_s']} s; {result['cpu_us_per_step_total']} us CPU per step "
            f"({result['cpu_us_per_step']})"
        )
    if "limit" in extra:
        floor, cap = extra["work_floor"], extra["limit"]
        print(
            f"work floor, in one process without a broker: {floor['cpu_us_per_step_total']} us CPU "
            f"per step ({floor['cpu_us_per_step']}); with the bare client at 3 hops "
            f"({cap['client_us_per_step']} us) {cap['floor_us_per_step']} us: "
            f"at most {cap['steps_per_s']:,} steps/s on {cap['cores']} cores"
        )
        wire = extra["wire"]
        print(
            f"the three workers' own loops on the wire's bytes, no client: "
            f"{wire['cpu_us_per_step_total']} us CPU per step ({wire['cpu_us_per_step']}), "
            f"{wire['over_floor']:.2f}x the floor without the client"
        )
        for name, result in report["pipelines"].items():
            print(
                f"  pipeline {name}: {result['of_limit']:.2f} of that limit; its CPU per step "
                f"{result['cpu_over_floor']:.2f}x the floor ({result['cpu_over_floor_as_before']:.2f}x "
                f"the floor without {', '.join(floor['without'])})"
            )
    print("aim: >= 10,000 steps/s and >= 0.5x raw")


if __name__ == "__main__":
    main()
