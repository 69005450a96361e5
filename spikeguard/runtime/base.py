"""What a trainer's guard connects to (:class:`Runtime`), and the bus settings ask for.

Both runtime modes (the pipeline as threads of the trainer's process, or in
a child process: :mod:`spikeguard.runtime.threads`, :mod:`spikeguard.runtime.child`)
and the Kafka connection build on these two; nothing here starts a worker.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spikeguard.bus import Bus, EmbeddedBus
from spikeguard.errors import BusError, ConfigError
from spikeguard.pipeline_watch import PipelineWatch
from spikeguard.schemas import Topics
from spikeguard.settings import Settings
from spikeguard.streaming.worker import Worker

if TYPE_CHECKING:
    from spikeguard.bus.kafka import KafkaBus


def make_bus(settings: Settings) -> Bus:
    """The Kafka bus when ``bootstrap_servers`` is set, else the in-process one."""
    return kafka_bus(settings) if settings.bootstrap_servers else embedded_bus(settings)


def kafka_bus(settings: Settings) -> "KafkaBus":
    """The Kafka bus ``settings`` ask for, on the client they name (``kafka_client``)."""
    from spikeguard.bus.kafka import KafkaBus  # kafka-python is only needed here

    if not settings.bootstrap_servers:
        raise ConfigError("a Kafka bus needs bootstrap_servers")
    kind = KafkaBus
    if settings.kafka_client == "confluent":
        from spikeguard.bus.confluent import ConfluentBus  # ConfigError naming the extra if missing

        kind = ConfluentBus
    return kind(
        settings.bootstrap_servers,
        client_id=settings.client_id,
        security_protocol=settings.security_protocol,
        sasl_mechanism=settings.sasl_mechanism,
        sasl_username=settings.sasl_username,
        sasl_password=settings.sasl_password,
        ssl_cafile=settings.ssl_cafile,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
        partitions=settings.partitions,
        instance_id=settings.instance_id,
        session_timeout_ms=int(settings.session_timeout_s * 1000),
        heartbeat_interval_ms=int(settings.heartbeat_interval_s * 1000),
    )


def embedded_bus(settings: Settings) -> EmbeddedBus:
    """The in-process bus ``settings`` ask for (``bootstrap_servers`` aside)."""
    return EmbeddedBus(
        partitions=settings.partitions,
        data_dir=settings.data_dir,
        keep_consumed=settings.embedded_keep_consumed,
        max_records=settings.embedded_max_records,
    )


@dataclass
class Runtime:
    """What a guard connects to. ``bus`` is None when the broker could not be reached
    (``problem`` says why): the guard then trains with its local protections only."""

    bus: Bus | None
    topics: Topics
    settings: Settings
    workers: list[Worker] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    closers: list = field(default_factory=list)  # called after the threads stop (/metrics, alerts)
    problem: str | None = None
    watch: PipelineWatch | None = None
    #: The pipeline's child process (``worker.embedded_process``): its ``problem`` says if it died.
    child: object | None = None

    def connected_bus(self) -> Bus:
        """The bus; a :class:`~spikeguard.errors.BusError` saying why if there is none."""
        if self.bus is None:
            raise BusError(f"no bus: {self.problem or 'the runtime has none'}")
        return self.bus

    def close(self) -> None:
        """Stop the component threads (they save their state) and close the bus."""
        if self.watch is not None:
            self.watch.stop()
        for worker in self.workers:
            worker.stop()
        for thread in self.threads:
            thread.join(timeout=10)
        for close in self.closers:
            close()
        if self.bus is not None:
            self.bus.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
