"""Every metric of spikeguard, its groups on one registry."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from spikeguard.metrics.judging import JudgingMetrics
from spikeguard.metrics.monitor import MonitorMetrics
from spikeguard.metrics.runs import RunSeries
from spikeguard.metrics.steps import StepMetrics
from spikeguard.metrics.trainer import TrainerMetrics
from spikeguard.metrics.worker import WorkerMetrics


class Metrics(
    WorkerMetrics, TrainerMetrics, StepMetrics, JudgingMetrics, MonitorMetrics, RunSeries
):
    """Every spikeguard metric, on one registry (the global one by default)."""

    def __init__(
        self, registry: CollectorRegistry | None = None, run_idle_s: float = 3600.0
    ) -> None:
        self.registry = registry if registry is not None else REGISTRY
        r = self.registry
        WorkerMetrics.__init__(self, r)
        TrainerMetrics.__init__(self, r)
        StepMetrics.__init__(self, r)
        JudgingMetrics.__init__(self, r)
        MonitorMetrics.__init__(self, r)
        per_run = (*self.latest_step_gauges(), *self.health_gauges())
        RunSeries.__init__(self, r, run_idle_s, per_run)


_default: Metrics | None = None


def default_metrics() -> Metrics:
    """The process-wide metrics on the global registry (what `worker` exposes over HTTP)."""
    global _default
    if _default is None:
        _default = Metrics()
    return _default
