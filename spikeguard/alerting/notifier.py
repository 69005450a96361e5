"""One message per incident, delivered off the caller's thread, retried with backoff.

The monitor calls :meth:`Notifier.offer` for every decision; the first one of
an incident that reaches ``min_urgency`` becomes an :class:`Alert`, the rest
of that incident's steps are not news. Each channel has its own queue and
thread, so a slow SMTP server delays email only, never the webhook or the
worker loop. A channel that keeps failing is retried ``retries`` times with
exponential backoff, then the message is given up (logged and counted); a
burst of incidents beyond ``max_per_minute`` is dropped the same way, so a
bad night does not page a thousand times.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Iterable

from spikeguard.alerting.channels import (
    Alert,
    AlertDeliveryError,
    Channel,
    EmailChannel,
    LogChannel,
    WebhookChannel,
)
from spikeguard.alerting.config import AlertingConfig
from spikeguard.metrics import Metrics
from spikeguard.schemas import Decision, Urgency

log = logging.getLogger(__name__)

_RANK = {u: i for i, u in enumerate(Urgency)}
_REMEMBERED = 10_000  # incidents kept for de-duplication (oldest forgotten first)
_STOP = object()


class _Sender:
    """A channel's queue and thread: retries, backoff, rate limit."""

    def __init__(self, channel: Channel, notifier: "Notifier") -> None:
        self.channel = channel
        self.notifier = notifier
        self.queue: queue.Queue = queue.Queue(maxsize=notifier.queue_size)
        self.sent_at: deque[float] = deque()
        self.thread = threading.Thread(
            target=self._run, name=f"spikeguard-alert-{channel.name}", daemon=True
        )
        self.thread.start()

    def put(self, alert: Alert) -> None:
        try:
            self.queue.put_nowait(alert)
        except queue.Full:
            self.notifier._gave_up(self.channel.name, "queue_full", alert)

    def _allowed(self) -> bool:
        now = self.notifier.clock()
        while self.sent_at and now - self.sent_at[0] >= 60.0:
            self.sent_at.popleft()
        if len(self.sent_at) >= self.notifier.max_per_minute:
            return False
        self.sent_at.append(now)
        return True

    def _run(self) -> None:
        while True:
            alert = self.queue.get()
            try:
                if alert is _STOP:
                    return
                if not self._allowed():
                    self.notifier._gave_up(self.channel.name, "rate_limited", alert)
                    continue
                self._deliver(alert)
            finally:
                self.queue.task_done()

    def _deliver(self, alert: Alert) -> None:
        n = self.notifier
        for attempt in range(n.retries + 1):
            try:
                self.channel.send(alert)
            except AlertDeliveryError as exc:
                log.warning(
                    "alert to %s failed (attempt %d of %d): %s",
                    self.channel.name,
                    attempt + 1,
                    n.retries + 1,
                    exc,
                )
                if attempt < n.retries:
                    # Closing cuts the wait short; the remaining attempts then run at once.
                    n._closing.wait(min(n.backoff_max_s, n.backoff_s * 2**attempt))
                continue
            except Exception:
                log.exception("alert channel %s raised", self.channel.name)
                break
            if n.metrics is not None:
                n.metrics.alerts_sent.labels(self.channel.name).inc()
            return
        n._gave_up(self.channel.name, "undeliverable", alert)


class Notifier:
    """Turns decisions into at most one alert per incident, sent to every channel."""

    def __init__(
        self,
        channels: Iterable[Channel],
        *,
        min_urgency: Urgency = Urgency.HIGH,
        retries: int = 3,
        backoff_s: float = 1.0,
        backoff_max_s: float = 60.0,
        max_per_minute: int = 20,
        queue_size: int = 1000,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.min_urgency = Urgency(min_urgency)
        self.retries = retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.max_per_minute = max_per_minute
        self.queue_size = queue_size
        self.metrics = metrics
        self.clock = clock
        self.announced: OrderedDict[str, str] = OrderedDict()  # incident -> run
        self._closing = threading.Event()
        self._senders = [_Sender(channel, self) for channel in channels]

    @classmethod
    def from_config(cls, config: AlertingConfig, metrics: Metrics | None = None) -> "Notifier":
        channels: list[Channel] = [LogChannel()]
        if config.webhook_url:
            channels.append(WebhookChannel(config.webhook_url, config.timeout_s))
        if config.email_to:
            channels.append(
                EmailChannel(
                    config.smtp_host,
                    config.smtp_port,
                    config.email_from,
                    config.email_to,
                    timeout_s=config.timeout_s,
                    starttls=config.smtp_starttls,
                    username=config.smtp_username,
                    password=config.smtp_password,
                )
            )
        return cls(
            channels,
            min_urgency=config.min_urgency,
            retries=config.retries,
            backoff_s=config.backoff_s,
            backoff_max_s=config.backoff_max_s,
            max_per_minute=config.max_per_minute,
            queue_size=config.queue_size,
            metrics=metrics,
        )

    @property
    def channels(self) -> list[str]:
        return [s.channel.name for s in self._senders]

    def offer(self, decision: Decision, seen: float | None = None) -> Alert | None:
        """The alert this decision raises (queued for every channel), or None if it is no news."""
        if not decision.is_anomaly or _RANK[decision.urgency] < _RANK[self.min_urgency]:
            return None
        incident = decision.incident_id or decision.decision_id
        if incident in self.announced:
            return None
        self.announced[incident] = decision.run_id
        while len(self.announced) > _REMEMBERED:
            self.announced.popitem(last=False)
        alert = Alert.from_decision(decision, time.time() if seen is None else seen)
        for sender in self._senders:
            sender.put(alert)
        return alert

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued message was delivered or given up; False on timeout."""
        deadline = time.monotonic() + timeout
        for sender in self._senders:
            while sender.queue.unfinished_tasks:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.01)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Deliver what is queued (backoff waits cut short), then stop the threads."""
        self._closing.set()
        for sender in self._senders:
            try:
                sender.queue.put(_STOP, timeout=timeout)
            except queue.Full:
                log.warning("alert channel %s: queue still full on close", sender.channel.name)
        for sender in self._senders:
            sender.thread.join(timeout)

    # -- state (so a restarted monitor does not announce an incident again) ----
    def state_dict(self, run_ids: Iterable[str] | None = None) -> dict[str, Any]:
        runs = None if run_ids is None else set(run_ids)
        return {
            "announced": [[i, r] for i, r in self.announced.items() if runs is None or r in runs]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for incident, run_id in state.get("announced", []):
            self.announced[incident] = run_id

    def forget(self, run_ids: Iterable[str]) -> None:
        runs = set(run_ids)
        for incident in [i for i, r in self.announced.items() if r in runs]:
            del self.announced[incident]

    def _gave_up(self, channel: str, reason: str, alert: Alert) -> None:
        log.error("alert to %s dropped (%s): %s", channel, reason, alert.title)
        if self.metrics is not None:
            self.metrics.alerts_failed.labels(channel, reason).inc()
