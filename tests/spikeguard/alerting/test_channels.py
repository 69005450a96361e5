"""Each channel against a real local server: delivered, down, slow, refusing."""

from __future__ import annotations

import logging

import pytest

from spikeguard.alerting import Alert, AlertDeliveryError, EmailChannel, LogChannel, WebhookChannel


def _alert(**changes) -> Alert:
    fields = dict(
        run_id="r1",
        incident_id="inc-1",
        step=120,
        epoch=0,
        type="loss_spike",
        urgency="critical",
        confidence=0.93,
        critical=True,
        detectors={"statistical": 0.9, "rules": 1.0},
        rules=["nonfinite_loss"],
        time=1_700_000_000.0,
    )
    fields.update(changes)
    return Alert(**fields)


def test_webhook_posts_slack_compatible_json(webhook):
    server = webhook()
    WebhookChannel(server.url).send(_alert())
    (post,) = server.posts
    assert post["text"] == "[spikeguard] critical loss_spike in run r1 at step 120"
    assert post["blocks"][0]["type"] == "section"
    assert "statistical 0.90" in post["blocks"][0]["text"]["text"]
    assert post["spikeguard"]["incident_id"] == "inc-1"


def test_webhook_down_slow_and_refusing_are_delivery_errors(webhook, down_port):
    with pytest.raises(AlertDeliveryError, match="unreachable"):
        WebhookChannel(f"http://127.0.0.1:{down_port}/hook", timeout_s=2).send(_alert())
    slow = webhook(delay=1.0)
    with pytest.raises(AlertDeliveryError):
        WebhookChannel(slow.url, timeout_s=0.2).send(_alert())
    refusing = webhook(failures=1)
    with pytest.raises(AlertDeliveryError, match="HTTP 500"):
        WebhookChannel(refusing.url).send(_alert())


def test_email_over_smtp(smtp):
    box, port = smtp()
    EmailChannel(
        "127.0.0.1", port, "guard@example.org", ["ops@example.org", "ml@example.org"]
    ).send(_alert())
    (envelope,) = box.messages
    assert envelope.mail_from == "guard@example.org"
    assert envelope.rcpt_tos == ["ops@example.org", "ml@example.org"]
    text = envelope.content.decode()
    assert "Subject: [spikeguard] critical loss_spike in run r1 at step 120" in text
    assert "rules: nonfinite_loss" in text and "2023-11-14 22:13:20 UTC" in text


def test_email_down_and_slow_are_delivery_errors(smtp, down_port):
    with pytest.raises(AlertDeliveryError):
        EmailChannel("127.0.0.1", down_port, "a@x", ["b@y"], timeout_s=2).send(_alert())
    box, port = smtp(delay=2.0)
    with pytest.raises(AlertDeliveryError):
        EmailChannel("127.0.0.1", port, "a@x", ["b@y"], timeout_s=0.3).send(_alert())


def test_log_channel_logs_critical_at_critical(caplog):
    with caplog.at_level(logging.WARNING, logger="spikeguard.alerts"):
        LogChannel().send(_alert())
        LogChannel().send(_alert(urgency="high"))
    assert [r.levelno for r in caplog.records] == [logging.CRITICAL, logging.WARNING]
    assert "run r1 at step 120" in caplog.records[0].getMessage()
