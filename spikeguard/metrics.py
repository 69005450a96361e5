"""Prometheus metrics, one prefix, label names fixed up front, no per-step labels.

Every component takes a :class:`Metrics`; tests pass one built on a fresh
``CollectorRegistry`` and read values back with ``registry.get_sample_value``.
``run_id`` is the only open-ended label, on a few per-run gauges that
dashboards need; a run is a handful of series, never one per step.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from spikeguard.schemas import Ack, Action, Decision, StepEvent, Verdict

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else REGISTRY
        r = self.registry
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
        self.batch_seconds = Histogram(
            "spikeguard_batch_processing_seconds",
            "Time to process one polled batch, publishing and flushing included.",
            ["component"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.lag_seconds = Histogram(
            "spikeguard_record_age_seconds",
            "Age of a record when its component processed it (end-to-end lag per hop).",
            ["component"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.verdicts = Counter(
            "spikeguard_verdicts_total",
            "Verdicts by detector and outcome.",
            ["detector", "anomaly"],
            registry=r,
        )
        self.decisions = Counter(
            "spikeguard_decisions_total",
            "Anomalous or preventive decisions by type and urgency.",
            ["type", "urgency"],
            registry=r,
        )
        self.actions = Counter(
            "spikeguard_actions_total", "Actions issued, by kind.", ["kind"], registry=r
        )
        self.acks = Counter(
            "spikeguard_acks_total", "Acks received, by kind and status.", ["kind", "status"],
            registry=r,
        )
        self.run_loss = Gauge(
            "spikeguard_run_loss", "Latest loss of a run.", ["run_id"], registry=r
        )
        self.run_grad_norm = Gauge(
            "spikeguard_run_grad_norm", "Latest gradient norm of a run.", ["run_id"], registry=r
        )
        self.run_health = Gauge(
            "spikeguard_run_instability_probability",
            "The predictor's latest probability of instability within its horizon.",
            ["run_id"],
            registry=r,
        )
        self.ignored = Counter(
            "spikeguard_ignored_records_total",
            "Records a stage ignored on purpose (late, stale, duplicate, abandoned), by reason.",
            ["component", "reason"],
            registry=r,
        )
        self.trainer_dropped = Counter(
            "spikeguard_trainer_dropped_events_total",
            "Events a trainer dropped because its send queue was full (broker away).",
            registry=r,
        )


_default: Metrics | None = None


def default_metrics() -> Metrics:
    """The process-wide metrics on the global registry (what `worker` exposes over HTTP)."""
    global _default
    if _default is None:
        _default = Metrics()
    return _default


def observe_outputs(metrics: Metrics, outputs: list[tuple[str, object]]) -> None:
    """Count what a stage produced, by what it is (verdicts, decisions, actions).

    Tallied per batch, then one label look-up per series (a look-up costs about
    a microsecond, several per step at backtest speed); a gauge only keeps its
    last value, so only each run's last one is set.
    """
    verdicts: dict[tuple[str, bool], int] = {}
    health: dict[str, float] = {}
    decisions: dict[tuple[str, str], int] = {}
    actions: dict[str, int] = {}
    for _, event in outputs:
        if isinstance(event, Verdict):
            key = (event.detector, event.is_anomaly)
            verdicts[key] = verdicts.get(key, 0) + 1
            if event.instability_probability is not None:
                health[event.run_id] = event.instability_probability
        elif isinstance(event, Decision):
            if event.is_anomaly or event.preventive:
                key2 = (event.type.value, event.urgency.value)
                decisions[key2] = decisions.get(key2, 0) + 1
        elif isinstance(event, Action):
            kind = event.kind.value
            actions[kind] = actions.get(kind, 0) + 1
    for (detector, anomaly), count in verdicts.items():
        metrics.verdicts.labels(detector, "true" if anomaly else "false").inc(count)
    for run_id, probability in health.items():
        metrics.run_health.labels(run_id).set(probability)
    for labels, count in decisions.items():
        metrics.decisions.labels(*labels).inc(count)
    for kind, count in actions.items():
        metrics.actions.labels(kind).inc(count)


def observe_ignored(metrics: Metrics, stage: Any) -> None:
    """What the stage ignored on purpose since the last call (its ``drain_ignored()``)."""
    for reason, count in stage.drain_ignored().items():
        metrics.ignored.labels(stage.name, reason).inc(count)


def observe_inputs(metrics: Metrics, items: list[tuple[str, object]]) -> None:
    """Per-run gauges from the newest step of each run, and acks by status."""
    newest: dict[str, StepEvent] = {}
    acks: dict[tuple[str, str], int] = {}
    for _, event in items:
        if isinstance(event, StepEvent):
            newest[event.run_id] = event
        elif isinstance(event, Ack):
            key = (event.kind.value, event.status.value)
            acks[key] = acks.get(key, 0) + 1
    for labels, count in acks.items():
        metrics.acks.labels(*labels).inc(count)
    for run_id, event in newest.items():
        metrics.run_loss.labels(run_id).set(event.loss)
        if event.grad_norm is not None:
            metrics.run_grad_norm.labels(run_id).set(event.grad_norm)
