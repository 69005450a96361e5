"""The worker loop's metrics: records in and out, dead letters, state, runs held, timing."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class WorkerMetrics:
    """What a component's worker loop counts (spikeguard/streaming), by ``component``."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.records_in = Counter(
            "spikeguard_records_consumed_total",
            "Records a component consumed.",
            ["component", "topic"],
            registry=r,
        )
        self.records_out = Counter(
            "spikeguard_records_published_total",
            "Records a component published.",
            ["component", "topic"],
            registry=r,
        )
        self.dead_letters = Counter(
            "spikeguard_dead_letters_total",
            "Records sent to the DLQ, by the error class that sent them.",
            ["component", "error"],
            registry=r,
        )
        self.unreadable_snapshots = Counter(
            "spikeguard_state_snapshots_unreadable_total",
            "State snapshots that could not be read (that partition started afresh).",
            ["component"],
            registry=r,
        )
        self.state_refused = Counter(
            "spikeguard_state_records_refused_total",
            "Run states not saved because their record would exceed the record size limit "
            "(a restart starts that run afresh).",
            ["component"],
            registry=r,
        )
        self.runs_evicted = Counter(
            "spikeguard_runs_evicted_total",
            "Runs a worker dropped from memory, by why (ended, idle).",
            ["component", "reason"],
            registry=r,
        )
        self.runs_refused = Counter(
            "spikeguard_runs_refused_total",
            "Records of a run a worker refused because it already held worker.max_runs runs "
            "(a flood of made-up run ids, or a limit set too low).",
            ["component"],
            registry=r,
        )
        self.runs_in_memory = Gauge(
            "spikeguard_runs_in_memory",
            "Runs whose state a worker holds in memory.",
            ["component"],
            registry=r,
        )
        self.batch_seconds = Histogram(
            "spikeguard_batch_processing_seconds",
            "Time to process one polled batch, publishing and flushing included.",
            ["component"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.lag_seconds = Histogram(
            "spikeguard_record_age_seconds",
            "Age of a record when its component processed it (end-to-end lag per hop).",
            ["component"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ignored = Counter(
            "spikeguard_ignored_records_total",
            "Records a stage ignored on purpose (late, stale, duplicate, abandoned), by reason.",
            ["component", "reason"],
            registry=r,
        )


def observe_ignored(metrics: WorkerMetrics, stage: Any) -> None:
    """What the stage ignored on purpose since the last call (its ``drain_ignored()``)."""
    for reason, count in stage.drain_ignored().items():
        metrics.ignored.labels(stage.name, reason).inc(count)
