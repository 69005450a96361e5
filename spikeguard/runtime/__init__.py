"""Opening spikeguard: a bus, and in embedded mode the whole pipeline.

``open_runtime()`` is what a trainer's guard calls. Embedded (no
``bootstrap_servers``): an in-process bus and the pipeline's components in a
child process bridged to it (:mod:`spikeguard.bus.embedded_process`), or as
threads of this process where a child cannot start, so five lines in a
training loop get the full pipeline with no infrastructure.
Kafka: only the connection; the components run as their own processes
(``spikeguard worker NAME``).
"""

from __future__ import annotations

import logging
import sys
import threading
from dataclasses import dataclass, field

from spikeguard.bus import Bus, EmbeddedBus
from spikeguard.errors import BusError
from spikeguard.components import COMPONENTS, build_stage
from spikeguard.metrics import Metrics
from spikeguard.pipeline_watch import PipelineWatch
from spikeguard.streaming.worker import Worker
from spikeguard.schemas import Topics
from spikeguard.settings import Settings, load_settings
from spikeguard.trust import ensure_signing_key

log = logging.getLogger(__name__)


def make_bus(settings: Settings) -> Bus:
    if settings.bootstrap_servers:
        from spikeguard.bus.kafka import KafkaBus  # kafka-python is only needed here

        kind = KafkaBus
        if settings.kafka_client == "confluent":
            from spikeguard.bus.confluent import ConfluentBus  # ConfigError naming the extra if missing

            kind = ConfluentBus
        return kind(
            settings.bootstrap_servers,
            client_id=settings.client_id,
            security_protocol=settings.security_protocol,
            sasl_mechanism=settings.sasl_mechanism,
            sasl_username=settings.sasl_username,
            sasl_password=settings.sasl_password,
            ssl_cafile=settings.ssl_cafile,
            ssl_certfile=settings.ssl_certfile,
            ssl_keyfile=settings.ssl_keyfile,
            partitions=settings.partitions,
            instance_id=settings.instance_id,
            session_timeout_ms=int(settings.session_timeout_s * 1000),
            heartbeat_interval_ms=int(settings.heartbeat_interval_s * 1000),
        )
    return EmbeddedBus(partitions=settings.partitions, data_dir=settings.data_dir,
                       keep_consumed=settings.embedded_keep_consumed,
                       max_records=settings.embedded_max_records)


@dataclass
class Runtime:
    """What a guard connects to. ``bus`` is None when the broker could not be reached
    (``problem`` says why): the guard then trains with its local protections only."""

    bus: Bus | None
    topics: Topics
    settings: Settings
    workers: list[Worker] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    closers: list = field(default_factory=list)  # called after the threads stop (/metrics, alerts)
    problem: str | None = None
    watch: PipelineWatch | None = None
    #: The pipeline's child process (``worker.embedded_process``): its ``problem`` says if it died.
    child: object | None = None

    def close(self) -> None:
        """Stop the component threads (they save their state) and close the bus."""
        if self.watch is not None:
            self.watch.stop()
        for worker in self.workers:
            worker.stop()
        for thread in self.threads:
            thread.join(timeout=10)
        for close in self.closers:
            close()
        if self.bus is not None:
            self.bus.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_workers(
    runtime: Runtime, names: tuple[str, ...] = COMPONENTS, metrics: Metrics | None = None
) -> None:
    """Run these components as daemon threads on the runtime's bus."""
    for name in names:
        worker = Worker(
            runtime.bus,
            build_stage(name, runtime.settings, runtime.topics),
            metrics=metrics,
            # In memory, a snapshot has nowhere to survive a crash: skip it.
            snapshots=runtime.bus.engine != "embedded" or runtime.settings.data_dir is not None,
            snapshot_interval_s=runtime.settings.snapshot_interval_s,
            poll_timeout_s=0.05,
            run_idle_ttl_s=runtime.settings.worker.run_idle_ttl_s,
            max_state_record_bytes=runtime.settings.worker.max_state_record_bytes,
            metrics_linger_s=runtime.settings.worker.ended_run_metrics_linger_s,
            batch_linger_s=runtime.settings.worker.embedded_batch_linger_s,
            max_runs=runtime.settings.worker.max_runs,
            max_input_record_bytes=runtime.settings.worker.max_input_record_bytes,
        )
        thread = threading.Thread(target=worker.run, name=f"spikeguard-{name}", daemon=True)
        runtime.workers.append(worker)
        runtime.threads.append(thread)
        thread.start()


def open_runtime(settings: Settings | None = None, metrics: Metrics | None = None) -> Runtime:
    """The bus (and, embedded, the pipeline) for a trainer's guard.

    Embedded, the pipeline's workers run in a child process by default
    (``worker.embedded_process``), as threads of this process where a child
    cannot start. Raises :class:`~spikeguard.trust.MissingSigningKey` on Kafka
    without a signing key or an explicit ``insecure``; embedded, a random key
    is made for this process and shared with its actuator through
    ``runtime.settings``.
    """
    settings = ensure_signing_key(settings or load_settings(), "the trainer's guard")
    if settings.engine == "embedded":
        runtime = None
        if settings.worker.embedded_process:
            runtime = _open_with_child(settings, metrics)
        if runtime is None:
            runtime = _embedded_runtime(settings, settings)
            start_workers(runtime, metrics=metrics)
            from spikeguard.alerting.service import start_monitoring  # /metrics, monitor, alerts

            start_monitoring(runtime, metrics)
        if settings.data_dir is not None:  # what `spikeguard replay` re-judges with by default
            _record_settings(settings)
        return runtime
    bus = make_bus(settings)
    topics = Topics(settings.topic_prefix)
    # Training must not wait on the network: a broker that does not answer
    # within connect_timeout_s leaves the trainer with its local protections.
    try:
        bus.probe(settings.connect_timeout_s)  # type: ignore[attr-defined]
        bus.create_topics(topics.compacted(), compacted=True)
        bus.create_topics(topics.all())
    except BusError as exc:
        log.warning("spikeguard: Kafka at %s is unreachable, training goes on with the local "
                    "protections only (non-finite skip), no pipeline: %s",
                    settings.bootstrap_servers, exc)
        bus.close()
        return Runtime(None, topics, settings, problem=str(exc))
    watch = PipelineWatch(bus, topics, str(settings.bootstrap_servers),
                          timeout_s=settings.connect_timeout_s, interval_s=settings.pipeline_check_s)
    watch.check()  # one line at start when workers are missing
    watch.start()
    return Runtime(bus, topics, settings, watch=watch)


def _embedded_runtime(settings: Settings, bus_settings: Settings) -> Runtime:
    """An in-process bus with every topic, and the runtime around it."""
    bus = make_bus(bus_settings)
    topics = Topics(settings.topic_prefix)
    bus.create_topics(topics.compacted(), compacted=True)  # before the workers create them plain
    bus.create_topics(topics.all())
    # The in-process pipeline refuses steps not signed with this key; a Guard handed
    # this bus directly (Guard(..., bus=runtime.bus)) finds the key here.
    bus.signing_key = settings.keys()  # type: ignore[attr-defined]
    return Runtime(bus, topics, settings)


def _open_with_child(settings: Settings, metrics: Metrics | None) -> Runtime | None:
    """The pipeline in a child process (its GIL apart from the trainer's); None where it cannot start.

    Only the child records into ``data_dir`` (its bus carries every topic of
    the pipeline); the trainer's bus stays in memory. ``/metrics`` is served
    here, the child's series merged in at each scrape.
    """
    if sys.platform == "win32":  # no passing of pipe ends to a child there
        log.info("spikeguard: the embedded pipeline runs as threads of this process "
                 "(a child process needs a Unix platform)")
        return None
    from spikeguard.bus.embedded_process import ChildPipeline

    runtime = _embedded_runtime(settings, settings.model_copy(update={"data_dir": None}))
    try:
        runtime.child = ChildPipeline(runtime)
    except BusError as exc:
        runtime.bus.close()  # type: ignore[union-attr]
        log.info("spikeguard: the embedded pipeline runs as threads of this process: %s", exc)
        return None
    runtime.closers.append(runtime.child.close)
    if settings.metrics_port is not None:
        from spikeguard.bus.embedded_metrics import combined_registry
        from spikeguard.metrics import default_metrics
        from spikeguard.metrics_http import LagCollector, serve

        local = [(metrics or default_metrics()).registry, LagCollector.for_bus(runtime.bus, runtime.topics.prefix)]
        server = serve(settings.metrics_port, combined_registry(local, runtime.child.metrics))
        runtime.closers.insert(0, server.close)  # before the child goes: a scrape still finds it
    return runtime


def _record_settings(settings: Settings) -> None:
    from spikeguard.producers.io_faults import describe
    from spikeguard.reporting.recorded_settings import save

    try:
        save(settings, settings.data_dir)
    except OSError as exc:  # a convenience for later replays, never a reason not to train
        log.warning("spikeguard: could not record the judging settings in %s: %s; training goes "
                    "on (a replay of this recording needs the settings given again)",
                    settings.data_dir, describe(exc))
