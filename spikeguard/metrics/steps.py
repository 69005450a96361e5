"""Metrics from what trainers publish: each run's newest step, its goodput, and acks.

Goodput follows Google's ml-goodput-measurement: badput is disruptions and the
progress they wasted. It is counted from step events, once per (epoch, step) per process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from spikeguard.schemas import StepEvent


class StepMetrics:
    """Per-run series from step events (removed when the run ends), and acks by status."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.acks = Counter(
            "spikeguard_acks_total",
            "Acks received, by kind and status.",
            ["kind", "status"],
            registry=r,
        )
        self.run_loss = Gauge(
            "spikeguard_run_loss", "Latest loss of a run.", ["run_id"], registry=r
        )
        self.run_grad_norm = Gauge(
            "spikeguard_run_grad_norm", "Latest gradient norm of a run.", ["run_id"], registry=r
        )
        self.run_last_step = Gauge(
            "spikeguard_run_last_step",
            "Newest step a run's trainer published.",
            ["run_id"],
            registry=r,
        )
        self.run_last_step_time = Gauge(
            "spikeguard_run_last_step_timestamp_seconds",
            "Wall-clock time (unix seconds) of a run's newest step: a hung trainer stops it.",
            ["run_id"],
            registry=r,
        )
        self.run_lr = Gauge(
            "spikeguard_run_lr",
            "LR of a run's newest step (the schedule times the Guard's factor, which LR actions "
            "change for the rest of the run).",
            ["run_id"],
            registry=r,
        )
        self.run_epoch = Gauge(
            "spikeguard_run_epoch",
            "A run's epoch (how many rollbacks it went through).",
            ["run_id"],
            registry=r,
        )
        self.run_reruns = Counter(
            "spikeguard_run_reruns_total",
            "Suspicious steps the Guard re-ran once (verify_reruns=1), by outcome: transient "
            "(the re-run differed: a device or data-loading fault; the re-run's update applied "
            "when its own values are clean, else skipped) or reproducible (the step itself is bad).",
            ["run_id", "outcome"],
            registry=r,
        )
        self.run_steps = Counter(
            "spikeguard_run_steps_total",
            "A run's optimizer steps by timeline: first (new progress) or rerun (a step run "
            "again after a rollback: badput).",
            ["run_id", "timeline"],
            registry=r,
        )
        self.run_updates_skipped = Counter(
            "spikeguard_run_updates_skipped_total",
            "Steps whose update the trainer skipped, by its skip_reason (non_finite, "
            "outlier_step, scaler_overflow, transient): badput.",
            ["run_id", "reason"],
            registry=r,
        )
        self.run_recovery_seconds = Counter(
            "spikeguard_run_recovery_seconds_total",
            "Wall time a run spent re-running steps after rollbacks (from its step events' times).",
            ["run_id"],
            registry=r,
        )
        self.run_goodput = Gauge(
            "spikeguard_run_goodput_ratio",
            "Share of a run's steps so far that were new progress with their update applied "
            "(1 - badput): first-timeline steps minus skipped updates, over all steps run.",
            ["run_id"],
            registry=r,
        )

    def latest_step_gauges(self) -> tuple[Gauge, ...]:
        """The gauges of a run's newest step: one series per run, removed when it ends."""
        return (
            self.run_loss,
            self.run_grad_norm,
            self.run_last_step,
            self.run_last_step_time,
            self.run_epoch,
            self.run_goodput,
            self.run_lr,
        )


class GoodputTally:
    """One run's goodput bookkeeping from its step events (what the counters are built from)."""

    __slots__ = ("first", "rerun", "skipped", "high", "last", "last_time")

    def __init__(self) -> None:
        self.first = self.rerun = self.skipped = 0
        self.high = -1  # the highest step seen on any timeline: at or below it is a re-run
        self.last: tuple[int, int] = (-1, -1)  # (epoch, step) last counted: later stages skip it
        self.last_time: float | None = None

    def count(self, event: StepEvent) -> tuple[str, float] | None:
        """The event's timeline and the re-run seconds it adds; None if already counted."""
        key = (event.epoch, event.step)
        if key <= self.last:
            return None
        self.last = key
        seconds, previous = 0.0, self.last_time
        self.last_time = event.time
        if event.step <= self.high:
            self.rerun += 1
            if previous is not None and event.time > previous:
                seconds = event.time - previous
            timeline = "rerun"
        else:
            self.high = event.step
            self.first += 1
            timeline = "first"
        if event.update_skipped:
            self.skipped += 1
        return timeline, seconds

    @property
    def ratio(self) -> float:
        total = self.first + self.rerun
        return max(0.0, self.first - self.skipped) / total if total else 1.0
