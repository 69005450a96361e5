"""``spikeguard worker NAME``: run one component (or ``all``) until stopped.

Against Kafka (``--bootstrap-servers`` / ``$SPIKEGUARD_BOOTSTRAP_SERVERS``) each
component is its own process, scaled out by running more of them: they share
the consumer group and split the partitions. SIGTERM or Ctrl-C stops it after
it saves its state and commits.

``spikeguard worker detectors`` hosts the four detectors in one process
behind one consumer of the steps: each step is fetched, decoded and
authenticated once instead of four times, for less CPU per step on a small
machine; each detector still publishes its own verdicts. It replaces the
four ``statistical``, ``rules``, ``ml`` and ``predictor`` workers (run one
layout or the other, not both: each judges every step).
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import threading

from spikeguard.cli._common import add_settings_flags, settings_from
from spikeguard.components import COHOSTED, COMPONENTS

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="run a pipeline component (statistical, rules, ml, predictor, fusion, actuator, all), "
        "or the four detectors in one process (detectors)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "name",
        choices=[*COMPONENTS, COHOSTED, "all"],
        help="the component to run; 'detectors': the four detectors behind one "
        "consumer (instead of their four workers)",
    )
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="on Kafka, run without SPIKEGUARD_SIGNING_KEY (nothing signed or checked: anyone who "
        "can write the steps, verdicts, decisions, checkpoints, acks, actions or runs topic steers "
        "the runs). Also SPIKEGUARD_INSECURE=1",
    )
    parser.add_argument(
        "--instance-id",
        metavar="NAME",
        help="Kafka static membership: a name stable across restarts of this worker and unique "
        "among its running copies (e.g. the pod name); a restart then takes its partitions back "
        "at once. Also SPIKEGUARD_INSTANCE_ID",
    )
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spikeguard.components import build_stage
    from spikeguard.metrics import default_metrics
    from spikeguard.streaming.worker import Worker
    from spikeguard.runtime import make_bus
    from spikeguard.schemas import Topics

    from spikeguard.trust import ensure_signing_key

    settings = settings_from(
        args, metrics_port=args.metrics_port, insecure=args.insecure, instance_id=args.instance_id
    )
    names = COMPONENTS if args.name == "all" else (args.name,)
    # On Kafka every component signs what it publishes and takes only signed inputs: without
    # the key a detector's verdicts, fusion's decisions and the actuator's actions are refused
    # downstream, and it would take anyone's steps, verdicts or decisions. Without a key (and no
    # --insecure) this raises: main() prints the one-line reason, exit 2. Embedded (a replay of
    # a data_dir), detectors keep judging what they read, as fusion and the actuator never did.
    if settings.engine != "embedded" or {"fusion", "actuator"} & set(names):
        settings = ensure_signing_key(settings, f"the {args.name} worker")
    if settings.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port)
    bus = make_bus(settings)
    topics = Topics(settings.topic_prefix)
    bus.create_topics(topics.compacted(), compacted=True)  # before the workers create their inputs
    bus.create_topics(topics.all())

    workers = [
        Worker(
            bus,
            build_stage(name, settings, topics),
            metrics=default_metrics(),
            snapshot_interval_s=settings.snapshot_interval_s,
            run_idle_ttl_s=settings.worker.run_idle_ttl_s,
            max_state_record_bytes=settings.worker.max_state_record_bytes,
            max_unacked_records=settings.worker.max_unacked_records,
            metrics_linger_s=settings.worker.ended_run_metrics_linger_s,
            max_runs=settings.worker.max_runs,
            max_input_record_bytes=settings.worker.max_input_record_bytes,
            unsigned_letters_per_interval=settings.worker.unsigned_letters_per_10s,
        )
        for name in names
    ]
    stopping = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        log.warning("signal %d: stopping", signum)
        stopping.set()
        for worker in workers:
            worker.stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    # A worker allocates many short-lived objects per record; fewer young-GC
    # passes (and the start-up heap frozen out of them) cut ~a third of its CPU.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    threads = [threading.Thread(target=w.run, name=w.stage.name) for w in workers]
    for thread in threads:
        thread.start()
    client = f" via {settings.kafka_client}" if settings.engine == "kafka" else ""
    print(
        f"spikeguard worker: {', '.join(names)} on {settings.engine}{client} "
        f"({settings.bootstrap_servers or 'in-process'}), prefix {settings.topic_prefix!r}",
        flush=True,
    )
    while any(t.is_alive() for t in threads):
        for thread in threads:
            thread.join(timeout=0.5)
        if any(w.failure is not None for w in workers):
            for (
                worker
            ) in workers:  # one component down: the process goes, its supervisor restarts it
                worker.stop()
    bus.close()
    failed = [reason for w in workers if (reason := w.failure_reason) is not None]
    if failed:
        # Non-zero, so that a restart-on-failure supervisor brings the worker back.
        print(f"spikeguard worker: cannot go on: {'; '.join(failed)}", file=sys.stderr, flush=True)
        return 1
    return 0
