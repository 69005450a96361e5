"""Where alerts go and how hard to try: ``settings.alerting`` (``SPIKEGUARD_ALERTING__*``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from spikeguard.schemas import Urgency


class AlertingConfig(BaseModel):
    """Alert channels. The log channel is always on; the others when configured."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_urgency: Urgency = Field(
        Urgency.HIGH, description="an incident is announced once a decision reaches this urgency"
    )
    webhook_url: str | None = Field(
        None, description="POST a Slack-compatible JSON message here (Slack, Mattermost, ...)"
    )
    email_to: list[str] = Field(default_factory=list, description="recipients; empty = no email")
    email_from: str = Field("spikeguard@localhost", description="sender address")
    smtp_host: str = Field("localhost", description="SMTP server")
    smtp_port: int = Field(25, ge=1, le=65535)
    smtp_starttls: bool = Field(False, description="upgrade the connection with STARTTLS")
    smtp_username: str | None = Field(None, description="log in when set")
    smtp_password: SecretStr | None = Field(None, description="never logged")
    timeout_s: float = Field(5.0, gt=0, description="per delivery attempt")
    retries: int = Field(3, ge=0, le=20, description="further attempts after a failed one")
    backoff_s: float = Field(
        1.0, ge=0, description="wait before the first retry; doubles each time"
    )
    backoff_max_s: float = Field(60.0, ge=0, description="longest wait between attempts")
    max_per_minute: int = Field(
        20, ge=1, description="per channel; beyond it messages are dropped (and counted)"
    )
    queue_size: int = Field(1000, ge=1, description="messages waiting for delivery, per channel")

    @field_validator("email_to", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        # From the environment a list arrives as "a@x, b@y".
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("webhook_url", mode="before")
    @classmethod
    def _http(cls, value: object) -> object:
        if value == "":  # an unset variable in docker-compose's ${VAR:-}
            return None
        if isinstance(value, str) and not value.startswith(("http://", "https://")):
            raise ValueError(f"webhook_url must be an http(s) URL, got {value!r}")
        return value
