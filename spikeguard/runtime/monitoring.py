"""Running the monitor: inside the embedded runtime, or as ``spikeguard monitor``.

:func:`start_monitoring` is the embedded runtime's hook: with ``metrics_port``
set it serves ``/metrics`` (consumer lag included), and with metrics served or
an alert channel configured it runs the monitor as one more thread.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from spikeguard.alerting.monitor import MonitorStage
from spikeguard.alerting.notifier import Notifier
from spikeguard.metrics import Metrics, default_metrics
from spikeguard.streaming.worker import Worker

if TYPE_CHECKING:
    from spikeguard.bus import Bus
    from spikeguard.runtime.base import Runtime
    from spikeguard.schemas import Topics
    from spikeguard.settings import Settings


def build_monitor(
    bus: "Bus",
    settings: "Settings",
    topics: "Topics",
    metrics: Metrics,
    *,
    snapshots: bool = True,
    snapshot_interval_s: float = 2.0,
    poll_timeout_s: float = 0.2,
) -> tuple[Worker, Notifier]:
    """The monitor's worker and its notifier (close both when done); the options are the
    worker loop's (:class:`~spikeguard.streaming.worker.Worker`)."""
    notifier = Notifier.from_config(settings.alerting, metrics)
    stage = MonitorStage(topics, metrics, notifier)
    # The worker loop counts the records it reads (acks among them) in the
    # metrics it is given; the monitor re-reads what the pipeline already
    # counted, so those loop counters go to a registry nobody scrapes.
    loop_metrics = Metrics(CollectorRegistry())
    worker = Worker(
        bus,
        stage,
        metrics=loop_metrics,
        snapshots=snapshots,
        snapshot_interval_s=snapshot_interval_s,
        poll_timeout_s=poll_timeout_s,
    )
    return worker, notifier


def alerting_configured(settings: "Settings") -> bool:
    return bool(settings.alerting.webhook_url or settings.alerting.email_to)


def start_monitoring(
    runtime: "Runtime", metrics: Metrics | None = None, serve_http: bool = True
) -> None:
    """The embedded runtime's hook: ``/metrics`` and the monitor thread, when asked for.

    ``serve_http=False``: the monitor only (its latencies counted into ``metrics``),
    for a pipeline in a child process whose ``/metrics`` the trainer's process serves.
    """
    settings = runtime.settings
    if not (settings.metrics_port is not None or alerting_configured(settings)):
        return
    bus = runtime.connected_bus()
    metrics = metrics or default_metrics()
    if serve_http and settings.metrics_port is not None:
        from spikeguard.metrics_http import serve

        server = serve(
            settings.metrics_port,
            metrics.registry,
            bus=bus,
            group_prefix=runtime.topics.prefix,
        )
        runtime.closers.append(server.close)
    worker, notifier = build_monitor(
        bus,
        settings,
        runtime.topics,
        metrics,
        snapshots=bus.engine != "embedded" or settings.data_dir is not None,
        snapshot_interval_s=settings.snapshot_interval_s,
        poll_timeout_s=0.05,
    )
    thread = threading.Thread(target=worker.run, name="spikeguard-monitor", daemon=True)
    runtime.workers.append(worker)
    runtime.threads.append(thread)
    runtime.closers.append(notifier.close)
    thread.start()
