"""Telling people: alert channels (log, webhook, email), and the monitor that feeds them.

The monitor reads the decisions (and steps, actions, acks) of every run,
keeps the per-run metrics that need more than one topic (decision latency,
action round trip), and sends one message per incident to the configured
channels, with retries, backoff and a rate limit, off the worker's thread.
"""

from spikeguard.alerting.channels import (
    Alert,
    AlertDeliveryError,
    Channel,
    EmailChannel,
    LogChannel,
    WebhookChannel,
)
from spikeguard.alerting.config import AlertingConfig
from spikeguard.alerting.notifier import Notifier

__all__ = [
    "Alert",
    "AlertDeliveryError",
    "AlertingConfig",
    "Channel",
    "EmailChannel",
    "LogChannel",
    "Notifier",
    "WebhookChannel",
]
