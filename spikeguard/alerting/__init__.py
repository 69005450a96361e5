"""Telling people: alert channels (log, webhook, email), and the monitor that feeds them.

The monitor reads the decisions (and steps, actions, acks) of every run,
keeps the per-run metrics that need more than one topic (decision latency,
action round trip), and sends one message per incident to the configured
channels, with retries, backoff and a rate limit, off the worker's thread.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

#: public name -> its module. Each loads on first use: the settings import only the config,
#: and a trainer that never alerts pays for neither the channels (smtplib, ssl, http) nor the
#: notifier (prometheus-client).
_LAZY = {
    "Alert": "spikeguard.alerting.channels",
    "AlertDeliveryError": "spikeguard.alerting.channels",
    "Channel": "spikeguard.alerting.channels",
    "EmailChannel": "spikeguard.alerting.channels",
    "LogChannel": "spikeguard.alerting.channels",
    "WebhookChannel": "spikeguard.alerting.channels",
    "AlertingConfig": "spikeguard.alerting.config",
    "Notifier": "spikeguard.alerting.notifier",
}

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

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'spikeguard.alerting' has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
