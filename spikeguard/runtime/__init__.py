"""Opening spikeguard: a bus, and in embedded mode the whole pipeline.

``open_runtime()`` is what a trainer's guard calls. Embedded (no
``bootstrap_servers``): an in-process bus and the pipeline's components in a
child process bridged to it (:mod:`spikeguard.runtime.child`), or as
threads of this process where a child cannot start
(:mod:`spikeguard.runtime.threads`), so five lines in a training loop get
the full pipeline with no infrastructure.
Kafka: only the connection; the components run as their own processes
(``spikeguard worker NAME``).
"""

from __future__ import annotations

import logging
import sys

from spikeguard.errors import BusError
from spikeguard.metrics import Metrics
from spikeguard.pipeline_watch import PipelineWatch
from spikeguard.runtime.base import Runtime, kafka_bus, make_bus
from spikeguard.runtime.threads import embedded_runtime, start_workers
from spikeguard.schemas import Topics
from spikeguard.settings import Settings, load_settings
from spikeguard.trust import ensure_signing_key

__all__ = ["Runtime", "make_bus", "open_runtime", "start_workers"]

log = logging.getLogger(__name__)


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
            runtime = embedded_runtime(settings, settings)
            start_workers(runtime, metrics=metrics)
            from spikeguard.runtime.monitoring import start_monitoring  # /metrics, monitor, alerts

            start_monitoring(runtime, metrics)
        if settings.data_dir is not None:  # what `spikeguard replay` re-judges with by default
            _record_settings(settings, settings.data_dir)
        return runtime
    bus = kafka_bus(settings)
    topics = Topics(settings.topic_prefix)
    # Training must not wait on the network: a broker that does not answer
    # within connect_timeout_s leaves the trainer with its local protections.
    try:
        bus.probe(settings.connect_timeout_s)
        bus.create_topics(topics.compacted(), compacted=True)
        bus.create_topics(topics.all())
    except BusError as exc:
        log.warning(
            "spikeguard: Kafka at %s is unreachable, training goes on with the local "
            "protections only (non-finite skip), no pipeline: %s",
            settings.bootstrap_servers,
            exc,
        )
        bus.close()
        return Runtime(None, topics, settings, problem=str(exc))
    watch = PipelineWatch(
        bus,
        topics,
        str(settings.bootstrap_servers),
        timeout_s=settings.connect_timeout_s,
        interval_s=settings.pipeline_check_s,
    )
    watch.check()  # one line at start when workers are missing
    watch.start()
    return Runtime(bus, topics, settings, watch=watch)


def _open_with_child(settings: Settings, metrics: Metrics | None) -> Runtime | None:
    """The pipeline in a child process (its GIL apart from the trainer's); None where it cannot start.

    Only the child records into ``data_dir`` (its bus carries every topic of
    the pipeline); the trainer's bus stays in memory. ``/metrics`` is served
    here, the child's series merged in at each scrape.
    """
    if sys.platform == "win32":  # no passing of pipe ends to a child there
        log.info(
            "spikeguard: the embedded pipeline runs as threads of this process "
            "(a child process needs a Unix platform)"
        )
        return None
    from spikeguard.runtime.child import ChildPipeline

    runtime = embedded_runtime(settings, settings.model_copy(update={"data_dir": None}))
    try:
        runtime.child = ChildPipeline(runtime)
    except BusError as exc:
        runtime.connected_bus().close()
        log.info("spikeguard: the embedded pipeline runs as threads of this process: %s", exc)
        return None
    runtime.closers.append(runtime.child.close)
    if settings.metrics_port is not None:
        from spikeguard.bus.embedded_metrics import combined_registry
        from spikeguard.metrics import default_metrics
        from spikeguard.metrics_http import LagCollector, serve

        local = [
            (metrics or default_metrics()).registry,
            LagCollector.for_bus(runtime.connected_bus(), runtime.topics.prefix),
        ]
        server = serve(settings.metrics_port, combined_registry(local, runtime.child.metrics))
        runtime.closers.insert(0, server.close)  # before the child goes: a scrape still finds it
    return runtime


def _record_settings(settings: Settings, data_dir: str) -> None:
    from spikeguard.producers.io_faults import describe
    from spikeguard.reporting.recorded_settings import save

    try:
        save(settings, data_dir)
    except OSError as exc:  # a convenience for later replays, never a reason not to train
        log.warning(
            "spikeguard: could not record the judging settings in %s: %s; training goes "
            "on (a replay of this recording needs the settings given again)",
            data_dir,
            describe(exc),
        )
