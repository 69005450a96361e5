"""Prometheus metrics, one prefix, label names fixed up front, no per-step labels.

Every component takes a :class:`Metrics`; tests pass one built on a fresh
``CollectorRegistry`` and read values back with ``registry.get_sample_value``.
``run_id`` is the only open-ended label, on a few per-run series that
dashboards and alerts need; a run is a handful of series, never one per step.
Cardinality stays bounded: a run's series are removed when it ends (its final
checkpoint, see :meth:`Metrics.forget_run`) or when it has been silent for
``run_idle_s`` (a trainer that died never says it ended).

Serving them over HTTP, and consumer lag, live in :mod:`spikeguard.metrics_http`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from spikeguard.schemas import Ack, Action, Decision, HealthLevel, StepEvent, StepVerdicts, Verdict
from spikeguard.schemas.actions import SkipBatchesParams

log = logging.getLogger(__name__)

M = TypeVar("M", Counter, Gauge, Histogram)

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
# A decision waits for every detector's watermark, an ack for the trainer's next
# steps: seconds to minutes, not milliseconds.
_SLOW_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Health levels as numbers, so that a gauge can carry them (0 best, 4 critical).
HEALTH_LEVELS = {level: i for i, level in enumerate(HealthLevel)}


class Metrics:
    def __init__(
        self, registry: CollectorRegistry | None = None, run_idle_s: float = 3600.0
    ) -> None:
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
        self.trainer_unprotected = Gauge(
            "spikeguard_trainer_unprotected",
            "1 while a trainer has steps the pipeline has not judged for longer than its "
            "guard.unprotected_after_s (no valid pulse from the actuator): it trains with its "
            "local protections only.",
            ["run_id"],
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
        self.trainer_io_errors = Counter(
            "spikeguard_trainer_io_errors_total",
            "Writes of a trainer's Guard that failed (full disk, read-only directory); "
            "training went on. By what was written: checkpoint, ledger, incident.",
            ["what"],
            registry=r,
        )
        # -- per run (removed when the run ends) -------------------------------
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
        self.run_last_actions_time = Gauge(
            "spikeguard_run_last_actions_timestamp_seconds",
            "When (unix seconds) a run last got this plan of actions: the kinds one decision "
            "caused, in the order issued and joined by '+' (rollback+skip_batches+scale_lr). "
            "One series per plan, so a dashboard draws one mark per plan, at its time.",
            ["run_id", "kinds"],
            registry=r,
        )
        self.run_epoch = Gauge(
            "spikeguard_run_epoch",
            "A run's epoch (how many rollbacks it went through).",
            ["run_id"],
            registry=r,
        )
        self.run_health_level = Gauge(
            "spikeguard_run_health_level",
            "The predictor's latest health level of a run: 0 excellent, 1 good, 2 warning, "
            "3 concerning, 4 critical.",
            ["run_id"],
            registry=r,
        )
        self.run_decisions = Counter(
            "spikeguard_run_decisions_total",
            "A run's anomalous or preventive decisions, by urgency.",
            ["run_id", "urgency"],
            registry=r,
        )
        self.run_last_decision_time = Gauge(
            "spikeguard_run_last_decision_timestamp_seconds",
            "When (unix seconds) a run last had an anomalous or preventive decision of this "
            "urgency; alerts compare it with time(), which a counter's first sample defeats.",
            ["run_id", "urgency"],
            registry=r,
        )
        self.run_anomalous_verdicts = Counter(
            "spikeguard_run_anomalous_verdicts_total",
            "A run's anomalous verdicts, by detector (which detectors fired, per run).",
            ["run_id", "detector"],
            registry=r,
        )
        self.run_actions = Counter(
            "spikeguard_run_actions_total",
            "Actions issued for a run, by kind.",
            ["run_id", "kind"],
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
        # -- goodput (after Google's ml-goodput-measurement: badput is disruptions and the
        # progress they wasted). Counted from step events, once per (epoch, step) per process.
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
        self.run_batches_skipped = Counter(
            "spikeguard_run_batches_skipped_total",
            "Batches the policy asked a run to skip (SKIP_BATCHES: the rewound window plus the "
            "extra): data not trained on.",
            ["run_id"],
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
        self.runs_tracked = Gauge(
            "spikeguard_runs_tracked", "Runs this process keeps per-run series for.", registry=r
        )
        # -- pipeline ---------------------------------------------------------
        self.decision_latency = Histogram(
            "spikeguard_decision_latency_seconds",
            "From a step's wall-clock time to its decision reaching the monitor.",
            buckets=_SLOW_BUCKETS,
            registry=r,
        )
        self.action_round_trip = Histogram(
            "spikeguard_action_round_trip_seconds",
            "From a decision reaching the monitor to the trainer's ack of an action it caused.",
            ["kind"],
            buckets=_SLOW_BUCKETS,
            registry=r,
        )
        self.alerts_sent = Counter(
            "spikeguard_alerts_sent_total",
            "Alert messages delivered, by channel.",
            ["channel"],
            registry=r,
        )
        self.alerts_failed = Counter(
            "spikeguard_alerts_failed_total",
            "Alert messages given up, by channel and why (undeliverable after every retry, "
            "rate_limited, queue_full).",
            ["channel", "reason"],
            registry=r,
        )
        #: Seconds of silence after which a run counts as ended (its series removed).
        self.run_idle_s = run_idle_s
        self._per_run = (
            self.run_loss,
            self.run_grad_norm,
            self.run_health,
            self.run_last_step,
            self.run_last_step_time,
            self.run_epoch,
            self.run_health_level,
            self.run_goodput,
            self.run_lr,
        )
        self._goodput: dict[str, GoodputTally] = {}
        self._run_series: dict[str, set[tuple[MetricWrapperBase, tuple[str, ...]]]] = {}
        self._run_seen: dict[str, float] = {}
        self._next_sweep = 0.0
        self._lock = threading.Lock()

    # -- per-run series -------------------------------------------------------
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
            try:
                metric.remove(run_id, *labels)
            except KeyError:
                pass  # never set in this process
        self.runs_tracked.set(len(self._run_seen))


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


def skipped_batches(action: Action) -> int:
    """Batches a SKIP_BATCHES action skips (0 for any other kind)."""
    p = action.params
    if not isinstance(p, SkipBatchesParams):  # an Action's params always match its kind
        return 0
    return max(0, p.to_step - p.from_step + 1) + p.extra


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
    run_verdicts: dict[tuple[str, str], int] = {}
    health: dict[str, float] = {}
    levels: dict[str, int] = {}
    decisions: dict[tuple[str, str], int] = {}
    run_decisions: dict[tuple[str, str], int] = {}
    actions: dict[str, int] = {}
    run_actions: dict[tuple[str, str], int] = {}
    plans: dict[tuple[str, str], list[str]] = {}  # (run_id, decision) -> kinds, as issued
    runs: set[str] = set()
    if any(type(event) is StepVerdicts for _, event in outputs):  # counted as their verdicts
        outputs = [
            (topic, verdict)
            for topic, event in outputs
            for verdict in (event.verdicts if isinstance(event, StepVerdicts) else (event,))
        ]
    for _, event in outputs:
        if isinstance(event, Verdict):
            key = (event.detector, event.is_anomaly)
            verdicts[key] = verdicts.get(key, 0) + 1
            if event.is_anomaly:
                key5 = (event.run_id, event.detector)
                run_verdicts[key5] = run_verdicts.get(key5, 0) + 1
            if event.instability_probability is not None:
                health[event.run_id] = event.instability_probability
            if event.health is not None:
                levels[event.run_id] = HEALTH_LEVELS[event.health]
        elif isinstance(event, Decision):
            if event.is_anomaly or event.preventive:
                key2 = (event.type.value, event.urgency.value)
                decisions[key2] = decisions.get(key2, 0) + 1
                key3 = (event.run_id, event.urgency.value)
                run_decisions[key3] = run_decisions.get(key3, 0) + 1
        elif isinstance(event, Action):
            kind = event.kind.value
            actions[kind] = actions.get(kind, 0) + 1
            key4 = (event.run_id, kind)
            run_actions[key4] = run_actions.get(key4, 0) + 1
            kinds = plans.setdefault((event.run_id, event.decision_id or event.action_id), [])
            if kind not in kinds:
                kinds.append(kind)
            if skipped := skipped_batches(event):
                metrics.run_labels(metrics.run_batches_skipped, event.run_id).inc(skipped)
        else:
            continue
        runs.add(event.run_id)
    for (detector, anomaly), count in verdicts.items():
        metrics.verdicts.labels(detector, "true" if anomaly else "false").inc(count)
    for (run_id, detector), count in run_verdicts.items():
        metrics.run_labels(metrics.run_anomalous_verdicts, run_id, detector).inc(count)
    for run_id, probability in health.items():
        metrics.run_health.labels(run_id).set(probability)
    for run_id, level in levels.items():
        metrics.run_health_level.labels(run_id).set(level)
    for labels, count in decisions.items():
        metrics.decisions.labels(*labels).inc(count)
    now = time.time()
    for (run_id, urgency), count in run_decisions.items():
        metrics.run_labels(metrics.run_decisions, run_id, urgency).inc(count)
        metrics.run_labels(metrics.run_last_decision_time, run_id, urgency).set(now)
    for kind, count in actions.items():
        metrics.actions.labels(kind).inc(count)
    for (run_id, kind), count in run_actions.items():
        metrics.run_labels(metrics.run_actions, run_id, kind).inc(count)
    for (run_id, _), kinds in plans.items():
        metrics.run_labels(metrics.run_last_actions_time, run_id, "+".join(kinds)).set(now)
    if runs:
        metrics.touch_runs(runs, now)


def _tally(metrics: Metrics, run_id: str) -> GoodputTally:
    with metrics._lock:
        tally = metrics._goodput.get(run_id)
        if tally is None:
            tally = metrics._goodput[run_id] = GoodputTally()
        return tally


def observe_ignored(metrics: Metrics, stage: Any) -> None:
    """What the stage ignored on purpose since the last call (its ``drain_ignored()``)."""
    for reason, count in stage.drain_ignored().items():
        metrics.ignored.labels(stage.name, reason).inc(count)


def observe_inputs(metrics: Metrics, items: list[tuple[str, object]]) -> None:
    """Per-run gauges from the newest step of each run, and acks by status."""
    newest: dict[str, StepEvent] = {}
    acks: dict[tuple[str, str], int] = {}
    reruns: dict[tuple[str, str], int] = {}
    # Step counts tallied per batch, then one label look-up per series (not one per step).
    steps: dict[tuple[str, str], int] = {}  # (run_id, timeline) -> steps counted
    skipped: dict[tuple[str, str], int] = {}  # (run_id, reason) -> updates skipped
    tallies: dict[str, GoodputTally] = {}
    for _, event in items:
        if isinstance(event, StepEvent):
            run_id = event.run_id
            newest[run_id] = event
            tally = tallies.get(run_id)
            if tally is None:
                tally = tallies[run_id] = _tally(metrics, run_id)
            counted = tally.count(event)
            if counted is not None:
                timeline, seconds = counted
                key = (run_id, timeline)
                steps[key] = steps.get(key, 0) + 1
                if seconds:  # re-run steps only: rare, added one by one as they come
                    metrics.run_labels(metrics.run_recovery_seconds, run_id).inc(seconds)
                if event.update_skipped:
                    key = (run_id, event.skip_reason or "unknown")
                    skipped[key] = skipped.get(key, 0) + 1
            if event.rerun is not None:  # rare: a suspicious step the Guard re-ran
                key = (run_id, event.rerun)
                reruns[key] = reruns.get(key, 0) + 1
        elif isinstance(event, Ack):
            key = (event.kind.value, event.status.value)
            acks[key] = acks.get(key, 0) + 1
    for labels, count in acks.items():
        metrics.acks.labels(*labels).inc(count)
    for (run_id, timeline), count in steps.items():
        metrics.run_labels(metrics.run_steps, run_id, timeline).inc(count)
    for (run_id, reason), count in skipped.items():
        metrics.run_labels(metrics.run_updates_skipped, run_id, reason).inc(count)
    for (run_id, outcome), count in reruns.items():
        metrics.run_labels(metrics.run_reruns, run_id, outcome).inc(count)
    for run_id in dict.fromkeys(run_id for run_id, _ in steps):
        metrics.run_goodput.labels(run_id).set(_tally(metrics, run_id).ratio)
    for run_id, event in newest.items():
        metrics.run_loss.labels(run_id).set(event.loss)
        if event.grad_norm is not None:
            metrics.run_grad_norm.labels(run_id).set(event.grad_norm)
        metrics.run_last_step.labels(run_id).set(event.step)
        metrics.run_last_step_time.labels(run_id).set(event.time)
        metrics.run_epoch.labels(run_id).set(event.epoch)
        if event.lr is not None:
            metrics.run_lr.labels(run_id).set(event.lr)
    if newest:
        metrics.touch_runs(newest)
