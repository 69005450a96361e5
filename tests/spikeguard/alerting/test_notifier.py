"""The notifier and the monitor: one message per incident, retries, backoff, rate limit."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from spikeguard.alerting import AlertingConfig, EmailChannel, Notifier, WebhookChannel
from spikeguard.alerting.monitor import MonitorStage
from spikeguard.bus import EmbeddedBus
from spikeguard.metrics import Metrics
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    Decision,
    StepEvent,
    Topics,
    Urgency,
)
from spikeguard.streaming.worker import Worker


def _decision(step: int, incident: str = "inc-1", urgency=Urgency.CRITICAL, run="r1", **kw):
    return Decision(
        decision_id=f"d-{run}-{step}",
        run_id=run,
        step=step,
        is_anomaly=True,
        urgency=urgency,
        incident_id=incident,
        incident_onset_step=100,
        **kw,
    )


def _metrics():
    registry = CollectorRegistry()
    return Metrics(registry), registry


def test_one_message_per_incident_not_per_step(webhook):
    server = webhook()
    metrics, registry = _metrics()
    notifier = Notifier([WebhookChannel(server.url)], metrics=metrics)
    raised = [notifier.offer(_decision(step)) for step in range(100, 130)]
    assert sum(a is not None for a in raised) == 1
    notifier.offer(_decision(200, incident="inc-2"))
    notifier.offer(_decision(300, incident="inc-3", urgency=Urgency.LOW))  # below min_urgency
    assert notifier.flush(10)
    notifier.close()
    assert [p["spikeguard"]["incident_id"] for p in server.posts] == ["inc-1", "inc-2"]
    assert registry.get_sample_value("spikeguard_alerts_sent_total", {"channel": "webhook"}) == 2


def test_retries_with_backoff_until_the_server_answers(webhook):
    server = webhook(failures=2)
    metrics, registry = _metrics()
    notifier = Notifier([WebhookChannel(server.url)], retries=3, backoff_s=0.05, metrics=metrics)
    started = time.monotonic()
    notifier.offer(_decision(100))
    assert notifier.flush(10)
    waited = time.monotonic() - started
    notifier.close()
    assert server.attempts == 3 and len(server.posts) == 1
    assert waited >= 0.05 + 0.1  # two backoffs, the second twice the first
    assert (
        registry.get_sample_value(
            "spikeguard_alerts_failed_total", {"channel": "webhook", "reason": "undeliverable"}
        )
        is None
    )


def test_a_server_that_stays_down_is_given_up_and_counted(down_port):
    metrics, registry = _metrics()
    notifier = Notifier(
        [WebhookChannel(f"http://127.0.0.1:{down_port}/", timeout_s=1)],
        retries=2,
        backoff_s=0.01,
        metrics=metrics,
    )
    notifier.offer(_decision(100))
    assert notifier.flush(10)
    notifier.close()
    assert (
        registry.get_sample_value(
            "spikeguard_alerts_failed_total", {"channel": "webhook", "reason": "undeliverable"}
        )
        == 1
    )


def test_rate_limit_drops_a_burst_beyond_max_per_minute(webhook):
    server = webhook()
    metrics, registry = _metrics()
    notifier = Notifier([WebhookChannel(server.url)], max_per_minute=2, metrics=metrics)
    for i in range(5):
        notifier.offer(_decision(100 + i, incident=f"inc-{i}"))
    assert notifier.flush(10)
    notifier.close()
    assert len(server.posts) == 2
    assert (
        registry.get_sample_value(
            "spikeguard_alerts_failed_total", {"channel": "webhook", "reason": "rate_limited"}
        )
        == 3
    )


def test_a_slow_mail_server_does_not_hold_up_the_webhook(webhook, smtp):
    hook = webhook()
    box, port = smtp(delay=1.5)
    notifier = Notifier(
        [EmailChannel("127.0.0.1", port, "a@x", ["b@y"], timeout_s=5), WebhookChannel(hook.url)],
        retries=0,
    )
    notifier.offer(_decision(100))
    deadline = time.monotonic() + 5
    while not hook.posts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hook.posts and not box.messages  # the webhook went out while SMTP was still busy
    assert notifier.flush(10)
    notifier.close()
    assert len(box.messages) == 1


def test_config_builds_the_channels():
    config = AlertingConfig(webhook_url="http://127.0.0.1:1/x", email_to="a@x, b@y")
    notifier = Notifier.from_config(config)
    assert notifier.channels == ["log", "webhook", "email"]
    notifier.close()


def test_the_monitor_worker_alerts_measures_and_survives_a_restart(webhook):
    """Steps, decisions, an action and its ack on a real embedded bus, through a real Worker."""
    server = webhook()
    bus, topics = EmbeddedBus(), Topics()
    bus.create_topics(topics.all())
    metrics, registry = _metrics()
    producer = bus.producer()
    events = [
        (topics.steps, StepEvent(run_id="r1", step=s, loss=1.0, time=time.time() - 2))
        for s in range(100, 105)
    ]
    events += [(topics.decisions, _decision(s)) for s in range(100, 105)]
    events += [
        (
            topics.actions,
            Action(
                action_id="a1",
                run_id="r1",
                kind=ActionKind.ROLLBACK,
                apply_at_step=106,
                decision_id="d-r1-100",
                params={"target_step": 90},
            ),
        )
    ]
    producer.publish_events(events)

    def worker():
        notifier = Notifier([WebhookChannel(server.url)], metrics=metrics)
        stage = MonitorStage(topics, metrics, notifier)
        return Worker(
            bus, stage, metrics=Metrics(CollectorRegistry()), snapshot_interval_s=0.0
        ), notifier

    first, notifier = worker()
    while first.run_once(timeout=0.2):
        pass
    producer.publish_events(
        [
            (
                topics.acks,
                Ack(
                    run_id="r1",
                    action_id="a1",
                    kind=ActionKind.ROLLBACK,
                    status=AckStatus.APPLIED,
                    step=106,
                ),
            )
        ]
    )
    while first.run_once(timeout=0.2):
        pass
    first.close()  # snapshots which incidents were announced
    notifier.flush(10)
    notifier.close()
    assert len(server.posts) == 1
    assert registry.get_sample_value("spikeguard_decision_latency_seconds_count") == 5
    assert registry.get_sample_value("spikeguard_decision_latency_seconds_sum") >= 5 * 2
    assert (
        registry.get_sample_value(
            "spikeguard_action_round_trip_seconds_count", {"kind": "rollback"}
        )
        == 1
    )
    # A restarted monitor re-reads later decisions of the same incident: no second message.
    producer.publish_events([(topics.decisions, _decision(s)) for s in range(105, 110)])
    second, notifier = worker()
    while second.run_once(timeout=0.2):
        pass
    second.close()
    notifier.flush(10)
    notifier.close()
    assert len(server.posts) == 1


def test_a_final_checkpoint_removes_the_run_s_series():
    from spikeguard.metrics import observe_inputs, observe_outputs
    from spikeguard.schemas import CheckpointEvent

    metrics, registry = _metrics()
    topics = Topics()
    stage = MonitorStage(topics, metrics)
    observe_inputs(metrics, [("s", StepEvent(run_id="r1", step=9, loss=1.0))])
    observe_outputs(metrics, [("d", _decision(9))])
    stage.handle_batch([(topics.steps, StepEvent(run_id="r1", step=9, loss=1.0))])
    assert registry.get_sample_value("spikeguard_run_last_step", {"run_id": "r1"}) == 9
    stage.handle_batch(
        [
            (
                topics.checkpoints,
                CheckpointEvent(
                    run_id="r1", step=9, checkpoint_id="c", healthy=True, reason="periodic"
                ),
            )
        ]
    )
    assert registry.get_sample_value("spikeguard_run_last_step", {"run_id": "r1"}) == 9
    stage.handle_batch(
        [
            (
                topics.checkpoints,
                CheckpointEvent(
                    run_id="r1", step=10, checkpoint_id="c2", healthy=True, reason="final"
                ),
            )
        ]
    )
    assert not [s for f in registry.collect() for s in f.samples if s.labels.get("run_id") == "r1"]
    assert "r1" not in stage.runs
