"""Per-run series and their end: a run's series go when it ends or falls silent.

``run_id`` is the only open-ended label, on a few per-run series that
dashboards and alerts need; a run is a handful of series, never one per step.
Cardinality stays bounded: a run's series are removed when it ends (its final
checkpoint, see :meth:`RunSeries.forget_run`) or when it has been silent for
``run_idle_s`` (a trainer that died never says it ended).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Iterable, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

if TYPE_CHECKING:
    from spikeguard.metrics.steps import GoodputTally

log = logging.getLogger("spikeguard.metrics")

M = TypeVar("M", Counter, Gauge, Histogram)


class RunSeries:
    """Which series each run has, so that its end (or silence) removes them all.

    Args:
        r: The registry of ``runs_tracked``.
        run_idle_s: Seconds of silence after which a run counts as ended.
        per_run: Gauges with one series per run (``run_id`` their only label), removed with it.
    """

    def __init__(self, r: CollectorRegistry, run_idle_s: float, per_run: tuple[Gauge, ...]) -> None:
        self.runs_tracked = Gauge(
            "spikeguard_runs_tracked", "Runs this process keeps per-run series for.", registry=r
        )
        #: Seconds of silence after which a run counts as ended (its series removed).
        self.run_idle_s = run_idle_s
        self._per_run = per_run
        # Each run's goodput tally (spikeguard.metrics.steps), forgotten with the run.
        self._goodput: dict[str, GoodputTally] = {}
        self._run_series: dict[str, set[tuple[MetricWrapperBase, tuple[str, ...]]]] = {}
        self._run_seen: dict[str, float] = {}
        self._next_sweep = 0.0
        self._lock = threading.Lock()

    def run_labels(self, metric: M, run_id: str, *labels: str) -> M:
        """``metric.labels(run_id, *labels)``, remembered so the run's end removes it."""
        with self._lock:
            self._run_series.setdefault(run_id, set()).add((metric, labels))
        return metric.labels(run_id, *labels)

    def touch_runs(self, run_ids: Iterable[str], now: float | None = None) -> None:
        """These runs were just seen; runs silent for ``run_idle_s`` are forgotten."""
        now = time.time() if now is None else now
        with self._lock:
            for run_id in run_ids:
                self._run_seen[run_id] = now
            due = now >= self._next_sweep
            if due:
                # Every tenth of the idle time: the sweep is O(runs), not per batch.
                self._next_sweep = now + max(1.0, self.run_idle_s / 10)
                idle = [run for run, seen in self._run_seen.items() if now - seen > self.run_idle_s]
            else:
                idle = []
        for run_id in idle:
            log.info("run %s silent for %.0fs: removing its metrics", run_id, self.run_idle_s)
            self.forget_run(run_id)
        self.runs_tracked.set(len(self._run_seen))

    def forget_run(self, run_id: str) -> None:
        """Remove every series labelled with this run (it ended)."""
        with self._lock:
            series = self._run_series.pop(run_id, set())
            self._run_seen.pop(run_id, None)
            self._goodput.pop(run_id, None)
        for gauge in self._per_run:
            series.add((gauge, ()))
        for metric, labels in series:
            with contextlib.suppress(KeyError):  # never set in this process
                metric.remove(run_id, *labels)
        self.runs_tracked.set(len(self._run_seen))
