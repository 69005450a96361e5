"""The monitor's metrics: decision latency, action round trips, alerts (spikeguard/alerting)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# A decision waits for every detector's watermark, an ack for the trainer's next
# steps: seconds to minutes, not milliseconds.
_SLOW_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class MonitorMetrics:
    """What the monitor measures end to end, and what its notifier delivered."""

    def __init__(self, r: CollectorRegistry) -> None:
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
