"""Settings: flags, then SPIKEGUARD_* environment variables, then a config file, then defaults.

Top-level fields map to ``SPIKEGUARD_<FIELD>`` (``SPIKEGUARD_BOOTSTRAP_SERVERS``);
a component's fields to ``SPIKEGUARD_<COMPONENT>__<FIELD>``
(``SPIKEGUARD_FUSION__THRESHOLD=0.5``). Flags use dotted names
(``--set fusion.threshold=0.5``). A config file (``--config FILE`` or
``SPIKEGUARD_CONFIG``; TOML, or YAML with pyyaml) holds the same names as
tables (``[fusion]`` / ``threshold = 0.5``). Every component carries its own
documented config model; an invalid value raises :class:`ConfigError` naming
the field and where the value came from, and a name that is no setting (a file
key, a ``SPIKEGUARD_*`` variable, a flag) is refused with the closest real name.
Secrets are ``SecretStr``: never in reprs or logs.
"""

from __future__ import annotations

import json
import os
from typing import Any, Literal, Mapping

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from spikeguard.actuators.policy import PolicyConfig
from spikeguard.alerting.config import AlertingConfig
from spikeguard.errors import ConfigError
from spikeguard.schemas.signing import Keyring, Role
from spikeguard.processors.detectors.ml import MLConfig
from spikeguard.processors.detectors.predictor import PredictorConfig
from spikeguard.processors.detectors.rules import RulesConfig
from spikeguard.processors.detectors.statistical import StatisticalConfig
from spikeguard.processors.fusion_config import FusionConfig
from spikeguard.producers.config import GuardConfig
from spikeguard.streaming.config import WorkerConfig
from spikeguard.settings_sources import (
    CONFIG_ENV,
    ENV_PREFIX,
    check_dotted,
    env_name,
    flatten_file,
    read_config_file,
    settings_from_env,
)

__all__ = [
    "ENV_PREFIX",
    "Settings",
    "load_settings",
    "load_settings_with_origins",
    "origin_of",
    "parse_assignments",
]


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bootstrap_servers: str | None = Field(
        None, description="Kafka brokers (host:port,...); unset = the embedded bus"
    )
    kafka_client: Literal["kafka-python", "confluent"] = Field(
        "kafka-python",
        description="which library speaks Kafka: kafka-python (pure Python, always installed) or "
        "confluent (confluent-kafka on librdkafka, pip install 'spikeguard[confluent]'): several "
        "times less CPU per record, so more steps/s per worker. Either one in any process of a pipeline",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="Kafka security protocol"
    )
    sasl_mechanism: str | None = Field(None, description="e.g. PLAIN, SCRAM-SHA-512")
    sasl_username: str | None = None
    sasl_password: SecretStr | None = Field(None, description="never logged")
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    client_id: str = Field("spikeguard", min_length=1)
    instance_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._-]{1,200}$",
        description="Kafka static membership (group.instance.id): a name stable across restarts "
        "and unique among the running copies of a component (e.g. the pod or service name). "
        "A worker restarted under the same name takes its partitions back at once instead of "
        "after the dead member's session expires; unset = dynamic members",
    )
    session_timeout_s: float = Field(
        10.0,
        ge=1.0,
        le=1800.0,
        description="Kafka consumer session: a member silent this long loses its partitions "
        "(the longest a crashed worker that does not come back leaves its stage blind)",
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0.0, description="Kafka consumer heartbeats; under a third of session_timeout_s"
    )
    connect_timeout_s: float = Field(
        5.0,
        gt=0.0,
        le=300.0,
        description="how long a trainer's guard waits for the Kafka broker at start before it "
        "trains on with its local protections only (and says so)",
    )
    pipeline_check_s: float = Field(
        15.0,
        ge=0.0,
        description="how often a trainer on Kafka checks that every component has a live worker "
        "(and says so when that changes); 0 = only at start",
    )
    topic_prefix: str = Field("spikeguard.", description="replays run under another prefix")
    partitions: int = Field(4, ge=1, le=1024, description="partitions of new topics")
    data_dir: str | None = Field(
        None, description="embedded bus: record every topic here so the run can be replayed"
    )
    embedded_keep_consumed: int = Field(
        1000,
        ge=0,
        description="embedded bus: records a partition keeps in memory behind the lowest offset its "
        "consumer groups committed (what read_all and a late reader still see); older ones are "
        "dropped, so a long run's memory stays flat (the recording in data_dir keeps everything)",
    )
    embedded_max_records: int = Field(
        100_000,
        ge=1,
        description="embedded bus: at most this many records per partition in memory, consumed or "
        "not; a component further behind than this loses the oldest and resumes at the earliest "
        "left (as Kafka's auto_offset_reset=earliest), with a warning",
    )
    signing_key: SecretStr | None = Field(
        None,
        description="HMAC-SHA256 key: actions are signed, trainers refuse unsigned ones; "
        "required on Kafka (see insecure); embedded mode makes a random one per process",
    )
    trainer_key: SecretStr | None = Field(
        None,
        description="the trainers' own key (steps, run events, checkpoints, acks); default signing_key",
    )
    detectors_key: SecretStr | None = Field(
        None,
        description="the detector workers' own key (verdicts); default signing_key",
    )
    fusion_key: SecretStr | None = Field(
        None,
        description="fusion's own key (decisions); default signing_key",
    )
    actuator_key: SecretStr | None = Field(
        None,
        description="the actuator's own key (actions); default signing_key",
    )
    insecure: bool = Field(
        False,
        description="on Kafka, let the guard and the actuator run without a signing key "
        "(anyone who can write the actions topic then steers the run); logged as a WARNING",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="serve Prometheus metrics on this port (workers, the embedded runtime)",
    )
    snapshot_interval_s: float = Field(
        2.0, gt=0, description="how often a worker snapshots its state and commits offsets"
    )

    statistical: StatisticalConfig = Field(default_factory=StatisticalConfig)
    rules: RulesConfig = Field(default_factory=RulesConfig)
    ml: MLConfig = Field(default_factory=MLConfig)
    predictor: PredictorConfig = Field(default_factory=PredictorConfig)
    fusion: FusionConfig = Field(default_factory=FusionConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    alerting: AlertingConfig = Field(default_factory=AlertingConfig)
    worker: WorkerConfig = Field(default_factory=WorkerConfig)

    def keys(self) -> "SecretStr | Keyring | None":
        """What this process signs and checks with: the shared ``signing_key`` when no role has
        a key of its own, else a keyring of each role's key (a role without one: the shared key,
        if any). None: no key at all."""
        roles = {
            Role.TRAINER: self.trainer_key,
            Role.DETECTORS: self.detectors_key,
            Role.FUSION: self.fusion_key,
            Role.ACTUATOR: self.actuator_key,
        }
        if all(key is None for key in roles.values()):
            return self.signing_key
        return Keyring({role: key or self.signing_key for role, key in roles.items()})

    @field_validator(
        "signing_key",
        "trainer_key",
        "detectors_key",
        "fusion_key",
        "actuator_key",
        "sasl_password",
        mode="before",
    )
    @classmethod
    def _empty_secret_is_none(cls, value: Any) -> Any:
        # `KEY=${KEY:-}` in a compose file or shell gives "": that is no key, not a key.
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        if isinstance(value, SecretStr) and not value.get_secret_value().strip():
            return None
        return value

    @model_validator(mode="after")
    def _heartbeats_fit_the_session(self) -> "Settings":
        if self.heartbeat_interval_s * 3 > self.session_timeout_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s:g}) must be at most a third of "
                f"session_timeout_s ({self.session_timeout_s:g}), or one late heartbeat ends the session"
            )
        return self

    @property
    def engine(self) -> str:
        return "kafka" if self.bootstrap_servers else "embedded"


def _parse(value: str) -> Any:
    """Environment values are text; JSON lists/objects/numbers are read as such."""
    text = value.strip()
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except ValueError:
            return value
    return value


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def load_settings(
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> Settings:
    """Defaults, overlaid by a config file, by ``SPIKEGUARD_*`` variables, by ``overrides`` (dotted keys).

    The file is ``config_file``, else ``$SPIKEGUARD_CONFIG`` from ``env``, else none.
    """
    return load_settings_with_origins(overrides, env, config_file)[0]


def load_settings_with_origins(
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> tuple[Settings, dict[str, str]]:
    """:func:`load_settings`, and where each value given came from (``{dotted name: source}``)."""
    env = os.environ if env is None else env
    tree: dict[str, Any] = {}
    origin: dict[str, str] = {}
    # Lowest first, so that each layer overwrites the one below it.
    config_file = config_file or env.get(CONFIG_ENV) or None
    if config_file is not None:
        where = f"config file {config_file}"
        for dotted, value in flatten_file(Settings, read_config_file(config_file), where).items():
            _set(tree, dotted, value)
            origin[dotted] = where
    for dotted, value in settings_from_env(Settings, env).items():
        _set(tree, dotted, _parse(value))
        origin[dotted] = f"environment variable {env_name(dotted)}"
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        check_dotted(Settings, dotted, f"flag {dotted}")
        _set(tree, dotted, value)
        origin[dotted] = f"flag {dotted}"
    try:
        return Settings.model_validate(tree), origin
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_url=False):
            where = ".".join(str(p) for p in error["loc"])
            problems.append(f"{where} ({origin_of(where, origin)}): {error['msg']}")
        raise ConfigError("invalid settings: " + "; ".join(problems)) from None


def origin_of(dotted: str, origin: Mapping[str, str]) -> str:
    """Where ``dotted`` came from: itself, or the component it was given with (a JSON object)."""
    parts = dotted.split(".")
    for depth in range(len(parts), 0, -1):
        source = origin.get(".".join(parts[:depth]))
        if source is not None:
            return source
    return "default"


def parse_assignments(items: list[str] | None) -> dict[str, str]:
    """``["fusion.threshold=0.5", ...]`` from repeated ``--set`` flags."""
    result: dict[str, str] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--set expects NAME=VALUE, got {item!r}")
        result[name.strip()] = _parse(value)
    return result
