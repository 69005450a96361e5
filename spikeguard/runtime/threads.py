"""The embedded pipeline as threads: an in-process bus and the components on it.

The trainer's process runs the workers itself where a child process cannot
start (:mod:`spikeguard.runtime.child`), and the child runs its workers
this same way on a bus of its own.
"""

from __future__ import annotations

import threading

from spikeguard.components import EMBEDDED_COMPONENTS, build_stage
from spikeguard.metrics import Metrics
from spikeguard.runtime.base import Runtime, make_bus
from spikeguard.schemas import Topics
from spikeguard.settings import Settings
from spikeguard.streaming.worker import Worker


def start_workers(
    runtime: Runtime, names: tuple[str, ...] = EMBEDDED_COMPONENTS, metrics: Metrics | None = None
) -> None:
    """Run these components as daemon threads on the runtime's bus (by default the detectors
    co-hosted in one worker, fusion and the actuator: :data:`~spikeguard.components.EMBEDDED_COMPONENTS`)."""
    bus = runtime.connected_bus()
    for name in names:
        worker = Worker(
            bus,
            build_stage(name, runtime.settings, runtime.topics),
            metrics=metrics,
            # In memory, a snapshot has nowhere to survive a crash: skip it.
            snapshots=bus.engine != "embedded" or runtime.settings.data_dir is not None,
            snapshot_interval_s=runtime.settings.snapshot_interval_s,
            poll_timeout_s=0.05,
            run_idle_ttl_s=runtime.settings.worker.run_idle_ttl_s,
            max_state_record_bytes=runtime.settings.worker.max_state_record_bytes,
            metrics_linger_s=runtime.settings.worker.ended_run_metrics_linger_s,
            batch_linger_s=runtime.settings.worker.embedded_batch_linger_s,
            max_runs=runtime.settings.worker.max_runs,
            max_input_record_bytes=runtime.settings.worker.max_input_record_bytes,
            unsigned_letters_per_interval=runtime.settings.worker.unsigned_letters_per_10s,
        )
        thread = threading.Thread(target=worker.run, name=f"spikeguard-{name}", daemon=True)
        runtime.workers.append(worker)
        runtime.threads.append(thread)
        thread.start()


def embedded_runtime(settings: Settings, bus_settings: Settings) -> Runtime:
    """An in-process bus with every topic, and the runtime around it."""
    bus = make_bus(bus_settings)
    topics = Topics(settings.topic_prefix)
    bus.create_topics(topics.compacted(), compacted=True)  # before the workers create them plain
    bus.create_topics(topics.all())
    # The pipeline refuses steps not signed with settings' key: a Guard takes it from the
    # runtime it is handed (Guard(..., runtime=runtime)).
    return Runtime(bus, topics, settings)
