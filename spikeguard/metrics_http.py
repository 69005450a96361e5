"""Metrics over HTTP, and consumer lag read from the bus at scrape time.

``serve(port)`` is what ``metrics_port`` / ``SPIKEGUARD_METRICS_PORT`` turns
on: the embedded runtime (a trainer's Guard) and ``spikeguard monitor`` call
it. Lag is measured against the bus rather than reported by each worker,
because a worker that is down or stuck is exactly the one that cannot say.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from spikeguard.metrics import default_metrics

if TYPE_CHECKING:
    from spikeguard.bus import Bus, EmbeddedBus
    from spikeguard.bus.kafka import KafkaBus
    from kafka import KafkaAdminClient, KafkaConsumer

log = logging.getLogger(__name__)

LagReader = Callable[[], dict[tuple[str, str, int], int]]


def embedded_lag(bus: "EmbeddedBus", group_prefix: str = "") -> dict[tuple[str, str, int], int]:
    """``(group, topic, partition) -> records not yet committed`` on the embedded bus."""
    return bus.consumer_lag(group_prefix)


class KafkaLag:
    """The same from a Kafka cluster: committed offsets against the end offsets.

    The two clients are kept between scrapes (a scrape every few seconds should
    not open connections each time) and reopened after an error.
    """

    def __init__(self, bus: "KafkaBus", group_prefix: str = "") -> None:
        self.config = bus._config()  # connection and credentials
        self.group_prefix = group_prefix
        self._admin: KafkaAdminClient | None = None
        self._reader: KafkaConsumer | None = None
        self._lock = threading.Lock()

    def __call__(self) -> dict[tuple[str, str, int], int]:
        from kafka import KafkaAdminClient, KafkaConsumer

        with self._lock:  # two concurrent scrapes share the clients one at a time
            try:
                if self._admin is None or self._reader is None:
                    self._admin = KafkaAdminClient(**self.config)
                    self._reader = KafkaConsumer(
                        **self.config, group_id=None, enable_auto_commit=False
                    )
                return self._read(self._admin, self._reader)
            except Exception:
                self.close()
                raise

    def _read(
        self, admin: "KafkaAdminClient", reader: "KafkaConsumer"
    ) -> dict[tuple[str, str, int], int]:
        committed = _committed_offsets(admin, self.group_prefix)
        partitions = list({tp for offsets in committed.values() for tp in offsets})
        ends = reader.end_offsets(partitions) if partitions else {}
        found: dict[tuple[str, str, int], int] = {}
        for group_id, offsets in committed.items():
            for tp, meta in offsets.items():
                if meta is None or meta.offset is None or meta.offset < 0:
                    continue  # nothing committed on this partition yet
                found[(group_id, tp.topic, tp.partition)] = max(0, ends.get(tp, 0) - meta.offset)
        return found

    def close(self) -> None:
        for client in (self._reader, self._admin):
            if client is not None:
                with contextlib.suppress(Exception):  # closing a broken client
                    client.close()
        self._admin = self._reader = None


def kafka_lag(bus: "KafkaBus", group_prefix: str = "") -> dict[tuple[str, str, int], int]:
    """One-off :class:`KafkaLag` reading."""
    reader = KafkaLag(bus, group_prefix)
    try:
        return reader()
    finally:
        reader.close()


def _committed_offsets(admin, group_prefix: str) -> dict:
    """``{group: {TopicPartition: OffsetAndMetadata}}`` of the groups under the prefix."""
    if hasattr(admin, "list_groups"):  # kafka-python 3.x: one OffsetFetch for every group
        groups = [
            g["group_id"] for g in admin.list_groups() if g["group_id"].startswith(group_prefix)
        ]
        return admin.list_group_offsets({g: None for g in groups}) if groups else {}
    groups = [g for g, *_ in admin.list_consumer_groups() if g.startswith(group_prefix)]
    return {g: admin.list_consumer_group_offsets(g) for g in groups}


class LagCollector:
    """``spikeguard_consumer_lag_records{group,topic,partition}``, read at scrape time.

    Lag is a property of the broker, not of one worker: a worker that is down
    or stuck cannot report its own lag, so this asks the bus on each scrape.
    A bus that cannot answer yields no samples (and logs), never a failed scrape.
    """

    def __init__(self, read: LagReader) -> None:
        self.read = read

    @classmethod
    def for_bus(cls, bus: "Bus", group_prefix: str = "") -> "LagCollector":
        from spikeguard.bus import EmbeddedBus

        if isinstance(bus, EmbeddedBus):
            return cls(lambda: embedded_lag(bus, group_prefix))
        from spikeguard.bus.kafka import KafkaBus

        if not isinstance(bus, KafkaBus):
            raise TypeError(f"no consumer lag for a {type(bus).__name__}")
        return cls(KafkaLag(bus, group_prefix))

    def describe(self) -> list:
        return []  # no describe-time call to the bus when registered

    def collect(self):
        family = GaugeMetricFamily(
            "spikeguard_consumer_lag_records",
            "Records a consumer group has not yet committed, per topic partition.",
            labels=["group", "topic", "partition"],
        )
        try:
            lags = self.read()
        except Exception as exc:  # noqa: BLE001 - a scrape must not fail with the broker
            log.warning("consumer lag unavailable: %r", exc)
            lags = {}
        for (group, topic, partition), lag in sorted(lags.items()):
            family.add_metric([group, topic, str(partition)], lag)
        yield family


# -- serving -------------------------------------------------------------------
class MetricsServer:
    """A running ``/metrics`` endpoint; :meth:`close` stops it and frees the port."""

    def __init__(
        self,
        server,
        thread: threading.Thread,
        registry: CollectorRegistry,
        collector: "LagCollector | None" = None,
    ) -> None:
        self._server, self._thread = server, thread
        self._registry, self._collector = registry, collector

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        if self._collector is not None:  # the next server on this registry adds its own
            self._registry.unregister(self._collector)
            if isinstance(self._collector.read, KafkaLag):
                self._collector.read.close()
            self._collector = None


def serve(
    port: int,
    registry: CollectorRegistry | None = None,
    addr: str = "0.0.0.0",
    bus: "Bus | None" = None,
    group_prefix: str = "",
) -> MetricsServer:
    """Serve ``registry`` (the process-wide one by default) on ``addr:port``; 0 picks a port.

    With ``bus``, consumer lag of the groups under ``group_prefix`` is served too.
    """
    from prometheus_client import start_http_server

    registry = registry if registry is not None else default_metrics().registry
    collector = LagCollector.for_bus(bus, group_prefix) if bus is not None else None
    server, thread = start_http_server(port, addr=addr, registry=registry)
    if collector is not None:
        registry.register(collector)
    return MetricsServer(server, thread, registry, collector)
