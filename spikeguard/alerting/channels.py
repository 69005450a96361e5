"""Alert channels: one message out per call, or :class:`AlertDeliveryError` saying why not.

A channel makes one attempt; retrying, backing off and rate limiting are the
notifier's job, so every channel gets them alike.
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Protocol

from pydantic import SecretStr

from spikeguard.errors import SpikeguardError
from spikeguard.schemas import Decision

if TYPE_CHECKING:
    from email.message import EmailMessage

log = logging.getLogger(__name__)


class AlertDeliveryError(SpikeguardError):
    """A channel could not deliver a message (server down, refused, too slow)."""


@dataclass(frozen=True)
class Alert:
    """What a person needs to know about one incident, from the decision that raised it."""

    run_id: str
    incident_id: str
    step: int
    epoch: int
    type: str
    urgency: str
    confidence: float
    critical: bool
    detectors: dict[str, float] = field(default_factory=dict)
    rules: list[str] = field(default_factory=list)
    time: float = 0.0  # unix seconds, when the monitor saw the decision

    @classmethod
    def from_decision(cls, decision: Decision, seen: float) -> "Alert":
        return cls(
            run_id=decision.run_id,
            incident_id=decision.incident_id or decision.decision_id,
            step=decision.incident_onset_step
            if decision.incident_onset_step is not None
            else decision.step,
            epoch=decision.epoch,
            type=decision.type.value,
            urgency=decision.urgency.value,
            confidence=decision.confidence,
            critical=decision.critical,
            detectors=dict(decision.detectors),
            rules=list(decision.rules),
            time=seen,
        )

    @property
    def title(self) -> str:
        return f"[spikeguard] {self.urgency} {self.type} in run {self.run_id} at step {self.step}"

    def text(self) -> str:
        when = datetime.fromtimestamp(self.time, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        said = ", ".join(f"{name} {score:.2f}" for name, score in sorted(self.detectors.items()))
        lines = [
            self.title,
            f"when: {when}; epoch {self.epoch}; confidence {self.confidence:.2f}",
            f"detectors: {said or 'none'}",
        ]
        if self.rules:
            lines.append(f"rules: {', '.join(self.rules)}")
        if self.critical:
            lines.append("critical: the recovery policy acts at once")
        lines.append(f"incident: {self.incident_id}")
        return "\n".join(lines)


class Channel(Protocol):
    name: str

    def send(self, alert: Alert) -> None:
        """Deliver once, or raise :class:`AlertDeliveryError`."""


class LogChannel:
    """Writes the alert to the ``spikeguard.alerts`` logger (always on)."""

    name = "log"

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger("spikeguard.alerts")

    def send(self, alert: Alert) -> None:
        level = logging.CRITICAL if alert.urgency == "critical" else logging.WARNING
        self.logger.log(level, "%s", alert.text().replace("\n", "; "))


class WebhookChannel:
    """POSTs Slack-compatible JSON (``text`` plus ``blocks``) to an incoming-webhook URL."""

    name = "webhook"

    def __init__(self, url: str, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s

    @staticmethod
    def payload(alert: Alert) -> dict:
        return {
            "text": alert.title,  # what Slack shows in notifications, and the fallback
            "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": alert.text()}}],
            "spikeguard": asdict(alert),  # the same facts, for machines
        }

    def send(self, alert: Alert) -> None:
        import urllib.error  # (here: ~10 ms of http and ssl a run that never alerts does not pay)
        import urllib.request

        body = json.dumps(self.payload(alert)).encode()
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            raise AlertDeliveryError(f"webhook answered HTTP {exc.code}") from exc
        except (urllib.error.URLError, OSError) as exc:  # refused, unreachable, timed out
            raise AlertDeliveryError(f"webhook unreachable: {exc}") from exc


class EmailChannel:
    """Sends a plain-text email over SMTP (STARTTLS and login optional)."""

    name = "email"

    def __init__(
        self,
        host: str,
        port: int,
        sender: str,
        recipients: list[str],
        *,
        timeout_s: float = 5.0,
        starttls: bool = False,
        username: str | None = None,
        password: SecretStr | None = None,
    ) -> None:
        if not recipients:
            raise ValueError("EmailChannel needs at least one recipient")
        self.host, self.port = host, port
        self.sender, self.recipients = sender, list(recipients)
        self.timeout_s, self.starttls = timeout_s, starttls
        self.username, self.password = username, password

    def message(self, alert: Alert) -> EmailMessage:
        from email.message import EmailMessage

        message = EmailMessage()
        message["Subject"] = alert.title
        message["From"] = self.sender
        message["To"] = ", ".join(self.recipients)
        message.set_content(alert.text() + "\n")
        return message

    def send(self, alert: Alert) -> None:
        import smtplib  # (here: smtplib and ssl, ~10 ms, only for a run that sends email)

        try:
            with smtplib.SMTP(self.host, self.port, timeout=self.timeout_s) as smtp:
                if self.starttls:
                    smtp.starttls()
                if self.username:
                    secret = self.password.get_secret_value() if self.password else ""
                    smtp.login(self.username, secret)
                smtp.send_message(self.message(alert))
        except (smtplib.SMTPException, OSError, socket.timeout) as exc:
            raise AlertDeliveryError(f"SMTP {self.host}:{self.port}: {exc!r}") from exc
