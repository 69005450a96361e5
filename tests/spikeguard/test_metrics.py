"""Metrics: Prometheus names, per-run series that go away, lag, drops, and /metrics served."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.metrics import Metrics, observe_inputs, observe_outputs
from spikeguard.metrics_http import LagCollector, embedded_lag, serve
from spikeguard.producers import BackgroundPublisher
from spikeguard.schemas import (
    Action,
    ActionKind,
    Decision,
    HealthLevel,
    StepEvent,
    Topics,
    Urgency,
    Verdict,
)


def _fresh() -> tuple[Metrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return Metrics(registry), registry


def test_names_follow_prometheus_conventions():
    metrics, registry = _fresh()
    for family in registry.collect():
        assert family.name.startswith("spikeguard_")
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
        for sample in family.samples:
            assert "step" not in sample.labels  # never a per-step label


def test_last_step_and_per_run_decisions_and_actions():
    metrics, registry = _fresh()
    observe_inputs(
        metrics,
        [("s", StepEvent(run_id="a", step=7, epoch=1, loss=2.0, grad_norm=3.0, time=1000.0))],
    )
    decision = Decision(
        decision_id="d1",
        run_id="a",
        step=7,
        is_anomaly=True,
        urgency=Urgency.CRITICAL,
        incident_id="i1",
    )
    action = Action(
        action_id="x1",
        run_id="a",
        kind=ActionKind.ROLLBACK,
        apply_at_step=8,
        params={"target_step": 5},
    )
    verdict = Verdict(
        run_id="a", step=7, detector="predictor", is_anomaly=False, health=HealthLevel.CRITICAL
    )
    before = time.time()
    observe_outputs(metrics, [("d", decision), ("a", action), ("v", verdict)])
    get = registry.get_sample_value
    assert get("spikeguard_run_last_step", {"run_id": "a"}) == 7
    assert get("spikeguard_run_last_step_timestamp_seconds", {"run_id": "a"}) == 1000.0
    assert get("spikeguard_run_epoch", {"run_id": "a"}) == 1
    assert get("spikeguard_run_decisions_total", {"run_id": "a", "urgency": "critical"}) == 1
    assert (
        get(
            "spikeguard_run_last_decision_timestamp_seconds", {"run_id": "a", "urgency": "critical"}
        )
        >= before
    )
    assert get("spikeguard_run_actions_total", {"run_id": "a", "kind": "rollback"}) == 1
    assert get("spikeguard_run_health_level", {"run_id": "a"}) == 4
    assert get("spikeguard_runs_tracked") == 1


def test_a_runs_series_are_removed_when_it_ends_and_when_it_goes_silent():
    metrics, registry = _fresh()
    metrics.run_idle_s = 100.0
    for run in ("a", "b"):
        observe_inputs(metrics, [("s", StepEvent(run_id=run, step=1, loss=1.0, grad_norm=1.0))])
        observe_outputs(
            metrics,
            [
                (
                    "d",
                    Decision(
                        decision_id=f"d-{run}",
                        run_id=run,
                        step=1,
                        is_anomaly=True,
                        urgency=Urgency.HIGH,
                    ),
                )
            ],
        )
    metrics.forget_run("a")
    names = {s.labels.get("run_id") for f in registry.collect() for s in f.samples}
    assert "a" not in names and "b" in names
    # b falls silent: the next sweep after run_idle_s removes it too.
    metrics.touch_runs(["c"], now=time.time() + 1000)
    names = {s.labels.get("run_id") for f in registry.collect() for s in f.samples}
    assert "b" not in names
    assert registry.get_sample_value("spikeguard_runs_tracked") == 1


def test_consumer_lag_per_partition_on_the_embedded_bus():
    bus, topics = EmbeddedBus(partitions=2), Topics()
    bus.create_topics([topics.steps])
    producer = bus.producer()
    for i in range(10):
        producer.publish_events([(topics.steps, StepEvent(run_id=f"r{i % 3}", step=i, loss=1.0))])
    consumer = bus.consumer("spikeguard.statistical", [topics.steps])
    assert sum(embedded_lag(bus, "spikeguard.").values()) == 10
    records = consumer.poll(4, timeout=1.0)
    consumer.commit()
    lag = embedded_lag(bus, "spikeguard.")
    assert sum(lag.values()) == 10 - len(records)
    assert {k[:2] for k in lag} == {("spikeguard.statistical", topics.steps)}
    registry = CollectorRegistry()
    registry.register(LagCollector.for_bus(bus, "spikeguard."))
    for (group, topic, partition), value in lag.items():
        assert (
            registry.get_sample_value(
                "spikeguard_consumer_lag_records",
                {"group": group, "topic": topic, "partition": str(partition)},
            )
            == value
        )


def test_a_lag_reader_that_fails_gives_no_samples_not_a_failed_scrape():
    def broken():
        raise ConnectionError("broker away")

    registry = CollectorRegistry()
    registry.register(LagCollector(broken))
    assert registry.get_sample_value("spikeguard_consumer_lag_records", {}) is None


def test_trainer_dropped_counts_what_the_publisher_drops(gated_producer):
    metrics, registry = _fresh()
    bus, topics = EmbeddedBus(), Topics()
    producer = gated_producer(bus)
    publisher = BackgroundPublisher(producer, "p", queue_size=5, interval=0.001, metrics=metrics)
    publisher.submit(topics.steps, StepEvent, dict(run_id="p", step=0, loss=1.0))
    assert producer.waiting.wait(10)  # the sender now hangs on the first record
    for i in range(1, 21):
        publisher.submit(topics.steps, StepEvent, dict(run_id="p", step=i, loss=1.0))
    assert publisher.dropped == 15
    assert registry.get_sample_value("spikeguard_trainer_dropped_events_total") == 15
    producer.gate.set()
    publisher.close()
    assert registry.get_sample_value("spikeguard_trainer_dropped_events_total") == publisher.dropped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_serve_exposes_a_registry_with_lag_and_stops():
    metrics, registry = _fresh()
    bus = EmbeddedBus()
    bus.create_topics(["spikeguard.steps"])
    bus.consumer("spikeguard.rules", ["spikeguard.steps"])
    metrics.trainer_dropped.inc(3)
    server = serve(0, registry, addr="127.0.0.1", bus=bus, group_prefix="spikeguard.")
    text = _scrape(server.port)
    assert "spikeguard_trainer_dropped_events_total 3.0" in text
    assert 'spikeguard_consumer_lag_records{group="spikeguard.rules"' in text
    port = server.port
    server.close()
    with pytest.raises(OSError):
        _scrape(port)
    serve(0, registry, addr="127.0.0.1", bus=bus).close()  # the lag collector was unregistered


def test_the_embedded_guard_serves_metrics_when_asked(tmp_path, monkeypatch):
    """A guarded demo run (NaN fault) on an embedded runtime with metrics_port set."""
    from spikeguard.demo.model import DemoSetup
    from spikeguard.demo.run import DEMO_SETTINGS, run_demo
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    port = _free_port()
    runtime = open_runtime(load_settings({**DEMO_SETTINGS, "metrics_port": port}))
    try:
        outcome = run_demo("nan", seed=0, setup=DemoSetup(steps=150), runtime=runtime)
        assert outcome.rollbacks >= 1
        text = _scrape(port)
    finally:
        runtime.close()
    run_lines = [line for line in text.splitlines() if 'run_id="demo-nan-0-' in line]
    assert any(line.startswith("spikeguard_run_last_step{") for line in run_lines)
    assert any(
        line.startswith("spikeguard_run_last_decision_timestamp_seconds{")
        and 'urgency="critical"' in line
        for line in run_lines
    )
    assert "spikeguard_consumer_lag_records{" in text
    # The pipeline counts in its own process (the default): its series are read off the port.
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["spikeguard_decision_latency_seconds_count"] > 0
    assert samples['spikeguard_action_round_trip_seconds_count{kind="rollback"}'] >= 1
    with pytest.raises(OSError):
        _scrape(port)  # closed with the runtime


def test_steps_the_guard_re_ran_are_counted_by_outcome_and_go_with_the_run():
    metrics, registry = _fresh()
    steps = [
        StepEvent(
            run_id="a",
            step=s,
            loss=1.0,
            grad_norm=1.0,
            rerun=rerun,
            skip_reason="transient" if rerun == "transient" else None,
        )
        for s, rerun in ((1, None), (2, "transient"), (3, "reproducible"), (4, "transient"))
    ]
    observe_inputs(metrics, [("s", e) for e in steps[:2]])
    observe_inputs(metrics, [("s", e) for e in steps[2:]])  # a second batch adds to the first
    get = registry.get_sample_value
    assert get("spikeguard_run_reruns_total", {"run_id": "a", "outcome": "transient"}) == 2
    assert get("spikeguard_run_reruns_total", {"run_id": "a", "outcome": "reproducible"}) == 1
    metrics.forget_run("a")
    assert get("spikeguard_run_reruns_total", {"run_id": "a", "outcome": "transient"}) is None


def test_goodput_counts_each_step_once_and_itemises_the_badput():
    """20 steps, a rollback to 10 at step 15 (steps 11..15 run again, 1 s each), one update
    skipped, a skip of 5 + 3 batches: goodput = (20 - 1) / 25. Two stages reading the same
    steps in one process count them once."""
    metrics, registry = _fresh()
    first = [StepEvent(run_id="g", step=s, loss=1.0, time=1000.0 + s) for s in range(1, 16)]
    first[6] = first[6].model_copy(update={"update_skipped": True, "skip_reason": "non_finite"})
    rerun = [
        StepEvent(run_id="g", step=s, epoch=1, loss=1.0, time=1015.0 + (s - 10))
        for s in range(11, 21)
    ]
    for batch in (first, rerun):
        items = [("s", e) for e in batch]
        observe_inputs(metrics, items)
        observe_inputs(metrics, items)  # a second stage of the same process
    skip = Action(
        action_id="k",
        run_id="g",
        kind=ActionKind.SKIP_BATCHES,
        apply_at_step=16,
        params={"from_step": 11, "to_step": 15, "extra": 3},
    )
    observe_outputs(metrics, [("a", skip)])
    get = registry.get_sample_value
    assert get("spikeguard_run_steps_total", {"run_id": "g", "timeline": "first"}) == 20
    assert get("spikeguard_run_steps_total", {"run_id": "g", "timeline": "rerun"}) == 5
    assert get("spikeguard_run_updates_skipped_total", {"run_id": "g", "reason": "non_finite"}) == 1
    assert get("spikeguard_run_batches_skipped_total", {"run_id": "g"}) == 8
    assert get("spikeguard_run_recovery_seconds_total", {"run_id": "g"}) == pytest.approx(5.0)
    assert get("spikeguard_run_goodput_ratio", {"run_id": "g"}) == pytest.approx(19 / 25)
    metrics.forget_run("g")
    assert get("spikeguard_run_goodput_ratio", {"run_id": "g"}) is None
    assert get("spikeguard_run_steps_total", {"run_id": "g", "timeline": "first"}) is None


def test_a_runs_lr_and_one_series_per_plan_of_actions_for_the_dashboard():
    """The LR of the newest step; a rollback's whole plan (one decision) is one series whose value
    is when it was issued, so the dashboard draws one mark there; a later plan adds its own."""
    metrics, registry = _fresh()
    get = registry.get_sample_value
    observe_inputs(
        metrics, [("s", StepEvent(run_id="a", step=s, loss=1.0, lr=0.01 / s)) for s in (1, 2)]
    )
    assert get("spikeguard_run_lr", {"run_id": "a"}) == pytest.approx(0.005)
    plan = [
        Action(
            action_id=f"p{i}",
            run_id="a",
            kind=kind,
            apply_at_step=9,
            params=params,
            decision_id="d9",
        )
        for i, (kind, params) in enumerate(
            [
                (ActionKind.ROLLBACK, {"target_step": 5}),
                (ActionKind.SKIP_BATCHES, {"from_step": 6, "to_step": 9, "extra": 2}),
                (ActionKind.SCALE_LR, {"factor": 0.5}),
            ]
        )
    ]
    before = time.time()
    observe_outputs(metrics, [("a", action) for action in plan])
    issued = get(
        "spikeguard_run_last_actions_timestamp_seconds",
        {"run_id": "a", "kinds": "rollback+skip_batches+scale_lr"},
    )
    assert before <= issued <= time.time()
    series = [
        s
        for f in registry.collect()
        for s in f.samples
        if s.name == "spikeguard_run_last_actions_timestamp_seconds"
    ]
    assert len(series) == 1
    restore = Action(
        action_id="r",
        run_id="a",
        kind=ActionKind.RESTORE_LR,
        apply_at_step=20,
        params={"factor": 2.0},
        decision_id="d19",
    )
    observe_outputs(metrics, [("a", restore)])
    assert (
        get("spikeguard_run_last_actions_timestamp_seconds", {"run_id": "a", "kinds": "restore_lr"})
        >= issued
    )
    assert (
        get(
            "spikeguard_run_last_actions_timestamp_seconds",
            {"run_id": "a", "kinds": "rollback+skip_batches+scale_lr"},
        )
        == issued
    )
    metrics.forget_run("a")
    assert get("spikeguard_run_lr", {"run_id": "a"}) is None
    assert (
        get("spikeguard_run_last_actions_timestamp_seconds", {"run_id": "a", "kinds": "restore_lr"})
        is None
    )
