"""The trainer's own metrics: unprotected time, dropped events, failed writes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class TrainerMetrics:
    """What a trainer's Guard counts in its own process (producers/)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.trainer_unprotected = Gauge(
            "spikeguard_trainer_unprotected",
            "1 while a trainer has steps the pipeline has not judged for longer than its "
            "guard.unprotected_after_s (no valid pulse from the actuator): it trains with its "
            "local protections only.",
            ["run_id"],
            registry=r,
        )
        self.trainer_dropped = Counter(
            "spikeguard_trainer_dropped_events_total",
            "Events a trainer dropped because its send queue was full (broker away).",
            registry=r,
        )
        self.trainer_io_errors = Counter(
            "spikeguard_trainer_io_errors_total",
            "Writes of a trainer's Guard that failed (full disk, read-only directory); "
            "training went on. By what was written: checkpoint, ledger, incident.",
            ["what"],
            registry=r,
        )
