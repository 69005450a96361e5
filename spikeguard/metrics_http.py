"""Metrics over HTTP, and consumer lag read from the bus at scrape time.

``serve(port)`` is what ``metrics_port`` / ``SPIKEGUARD_METRICS_PORT`` turns
on: the embedded runtime (a trainer's Guard) and ``spikeguard monitor`` call
it. Lag is measured against the bus rather than reported by each worker,
because a worker that is down or stuck is exactly the one that cannot say.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from spikeguard.metrics import default_metrics

if TYPE_CHECKING:
    from spikeguard.bus import Bus

log = logging.getLogger(__name__)

LagReader = Callable[[], dict[tuple[str, str, int], int]]


def embedded_lag(bus: "Bus", group_prefix: str = "") -> dict[tuple[str, str, int], int]:
    """``(group, topic, partition) -> records not yet committed`` on the embedded bus."""
    found: dict[tuple[str, str, int], int] = {}
    with bus._cond:  # type: ignore[attr-defined]  # the bus's own lock: a consistent view
        for group_name, group in bus._groups.items():  # type: ignore[attr-defined]
            if not group_name.startswith(group_prefix):
                continue
            topics = {t for member in group.members.values() for t in member.topics}
            topics |= {t for t, _ in group.committed}
            for topic_name in topics:
                topic = bus._topics.get(topic_name)  # type: ignore[attr-defined]
                if topic is None:
                    continue
                for partition, records in enumerate(topic.logs):
                    done = group.committed.get((topic_name, partition), 0)
                    found[(group_name, topic_name, partition)] = max(0, len(records) - done)
    return found


def kafka_lag(bus: "Bus", group_prefix: str = "") -> dict[tuple[str, str, int], int]:
    """The same from a Kafka cluster: committed offsets against the end offsets."""
    from kafka import KafkaAdminClient, KafkaConsumer

    config = bus._config()  # type: ignore[attr-defined]  # the connection, credentials included
    admin = KafkaAdminClient(**config)
    reader = KafkaConsumer(**config, group_id=None, enable_auto_commit=False)
    try:
        found: dict[tuple[str, str, int], int] = {}
        for group_id, *_ in admin.list_consumer_groups():
            if not group_id.startswith(group_prefix):
                continue
            committed = admin.list_consumer_group_offsets(group_id)
            if not committed:
                continue
            ends = reader.end_offsets(list(committed))
            for tp, meta in committed.items():
                if meta.offset is None or meta.offset < 0:
                    continue
                found[(group_id, tp.topic, tp.partition)] = max(0, ends.get(tp, 0) - meta.offset)
        return found
    finally:
        reader.close()
        admin.close()


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
        reader = kafka_lag if bus.engine == "kafka" else embedded_lag
        return cls(lambda: reader(bus, group_prefix))

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

    def __init__(self, server, thread: threading.Thread, registry: CollectorRegistry,
                 collector: "LagCollector | None" = None) -> None:
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
            self._collector = None


def serve(port: int, registry: CollectorRegistry | None = None, addr: str = "0.0.0.0",
          bus: "Bus | None" = None, group_prefix: str = "") -> MetricsServer:
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
