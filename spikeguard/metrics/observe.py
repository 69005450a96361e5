"""What a worker read and produced, counted into the groups' series (one batch at a time).

Tallied per batch, then one label look-up per series (a look-up costs about a
microsecond, several per step at backtest speed); a gauge only keeps its last
value, so only each run's last one is set.
"""

from __future__ import annotations

import time
from typing import Sequence

from spikeguard.metrics.judging import HEALTH_LEVELS, skipped_batches
from spikeguard.metrics.registry import Metrics
from spikeguard.metrics.steps import GoodputTally
from spikeguard.schemas import Ack, Action, Decision, StepEvent, StepVerdicts, Verdict


def observe_outputs(metrics: Metrics, outputs: Sequence[tuple[str, object]]) -> None:
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


def observe_inputs(metrics: Metrics, items: Sequence[tuple[str, object]]) -> None:
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
