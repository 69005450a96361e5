"""Prometheus metrics, one prefix, label names fixed up front, no per-step labels.

Every component takes a :class:`Metrics`; tests pass one built on a fresh
``CollectorRegistry`` and read values back with ``registry.get_sample_value``.
Its metrics are defined by group, each group in a module of its own:
:mod:`.worker` (the worker loop), :mod:`.trainer` (the Guard's own process),
:mod:`.steps` (what trainers publish: a run's newest step, goodput, acks),
:mod:`.judging` (what the pipeline decides), :mod:`.monitor` (latencies and
alerts), and :mod:`.runs` (per-run series, removed when a run ends or falls silent);
:mod:`.registry` puts them on one registry, and :mod:`.observe` counts a
worker's batch into them.

Serving them over HTTP, and consumer lag, live in :mod:`spikeguard.metrics_http`.
"""

from __future__ import annotations

from spikeguard.metrics.judging import HEALTH_LEVELS, skipped_batches
from spikeguard.metrics.observe import observe_inputs, observe_outputs
from spikeguard.metrics.registry import Metrics, default_metrics
from spikeguard.metrics.steps import GoodputTally
from spikeguard.metrics.worker import observe_ignored

__all__ = [
    "HEALTH_LEVELS",
    "GoodputTally",
    "Metrics",
    "default_metrics",
    "observe_ignored",
    "observe_inputs",
    "observe_outputs",
    "skipped_batches",
]
