"""Opening spikeguard: a bus, and in embedded mode the whole pipeline as threads.

``open_runtime()`` is what a trainer's guard calls. Embedded (no
``bootstrap_servers``): an in-process bus and one thread per component, so
five lines in a training loop get the full pipeline with no infrastructure.
Kafka: only the connection; the components run as their own processes
(``spikeguard worker NAME``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from spikeguard.bus import Bus, EmbeddedBus
from spikeguard.errors import BusError, ConfigError
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
    """The bus (and, embedded, the pipeline threads) for a trainer's guard.

    Raises :class:`~spikeguard.trust.MissingSigningKey` on Kafka without a
    signing key or an explicit ``insecure``; embedded, a random key is made
    for this process and shared with its actuator through ``runtime.settings``.
    """
    settings = ensure_signing_key(settings or load_settings(), "the trainer's guard")
    if settings.engine == "embedded" and settings.worker.embedded_process and settings.data_dir:
        raise ConfigError("worker.embedded_process: not with data_dir (two processes would "
                          "record into one directory); unset one of them")
    bus = make_bus(settings)
    topics = Topics(settings.topic_prefix)
    if settings.engine == "embedded":
        bus.create_topics(topics.compacted(), compacted=True)  # before the workers create them plain
        bus.create_topics(topics.all())
        # The in-process pipeline refuses steps not signed with this key; a Guard handed
        # this bus directly (Guard(..., bus=runtime.bus)) finds the key here.
        bus.signing_key = settings.keys()
        runtime = Runtime(bus, topics, settings)
        if settings.worker.embedded_process:  # the workers' GIL apart from the trainer's
            from spikeguard.bus.embedded_process import ChildPipeline

            runtime.child = ChildPipeline(runtime)
            runtime.closers.append(runtime.child.close)
            return runtime
        start_workers(runtime, metrics=metrics)
        from spikeguard.alerting.service import start_monitoring  # /metrics, monitor, alerts

        start_monitoring(runtime, metrics)
        if settings.data_dir is not None:  # what `spikeguard replay` re-judges with by default
            from spikeguard.producers.io_faults import describe
            from spikeguard.reporting.recorded_settings import save

            try:
                save(settings, settings.data_dir)
            except OSError as exc:  # a convenience for later replays, never a reason not to train
                log.warning("spikeguard: could not record the judging settings in %s: %s; training goes "
                            "on (a replay of this recording needs the settings given again)",
                            settings.data_dir, describe(exc))
        return runtime
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
