"""The Kafka engine on confluent-kafka (librdkafka), chosen with ``kafka_client = "confluent"``.

Why a second client: kafka-python builds and parses every record batch in
Python, 11-14 record operations per training step, >= ~250 us of CPU per step
before any detector runs; librdkafka does that work in C on its own threads.

Only the hot path changes: :class:`ConfluentBus` is a :class:`KafkaBus` whose
producer and consumer are librdkafka's. Topic creation, ``probe``,
``active_groups``, ``delete_records`` and ``read_all`` (admin and tooling
calls, not per step) stay on kafka-python, so both clients share one
definition of them. What must stay identical for the two clients to mix in
one pipeline: a key lands in the partition kafka-python's murmur2 picks
(``partitioner=murmur2_random``; librdkafka's default is CRC32), offsets are
committed only when the caller says so, and only what it polled.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable, Mapping

from spikeguard.bus.base import (
    Consumer,
    Headers,
    Producer,
    RebalanceCallback,
    Record,
    as_key,
    undelivered,
)
from spikeguard.bus.kafka import KafkaBus
from spikeguard.errors import BusError, CommitRefused, ConfigError, DeliveryError

try:
    import confluent_kafka as ck
except ImportError:  # pragma: no cover - exercised by test_a_missing_client_names_the_extra
    # Never used as None: every client is made after _require(), which raises
    # ConfigError naming the extra first.
    ck = None  # type: ignore[assignment]

__all__ = ["ConfluentBus", "librdkafka_options"]

#: librdkafka's linger for spikeguard's producers: how long a published record may wait
#: for more before it is sent without a flush (a worker's outputs, then, per hop).
SEND_LINGER_MS = 2

#: Error codes of a commit refused because the group went on without this member (CommitRefused).
_GROUP_MOVED_ON = (
    frozenset()
    if ck is None
    else frozenset(
        (
            ck.KafkaError.UNKNOWN_MEMBER_ID,
            ck.KafkaError.ILLEGAL_GENERATION,
            ck.KafkaError.REBALANCE_IN_PROGRESS,
            ck.KafkaError._ASSIGNMENT_LOST,
            ck.KafkaError.FENCED_INSTANCE_ID,
        )
    )
)

log = logging.getLogger(__name__)

# kafka-python option names whose librdkafka name is not the dotted form (None: no counterpart).
_RENAMED: dict[str, str | None] = {
    "fetch_max_wait_ms": "fetch.wait.max.ms",
    "max_poll_records": None,
    "request_timeout_ms": "socket.timeout.ms",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
    "ssl_cafile": "ssl.ca.location",
    "ssl_certfile": "ssl.certificate.location",
    "ssl_keyfile": "ssl.key.location",
}


def librdkafka_options(options: dict[str, Any]) -> dict[str, Any]:
    """kafka-python style option names (``session_timeout_ms``) as librdkafka's (``session.timeout.ms``).

    Dotted names pass through, so either spelling works in ``consumer_options``;
    an option librdkafka does not know is refused when the client is built.
    """
    out: dict[str, Any] = {}
    for name, value in options.items():
        theirs = name if "." in name else _RENAMED.get(name, name.replace("_", "."))
        if theirs is not None:  # None: no counterpart (poll(max_records) bounds each batch)
            out[theirs] = value
    return out


def _require() -> Any:
    if ck is None:
        raise ConfigError(
            "kafka_client='confluent' needs confluent-kafka: "
            "pip install 'spikeguard[confluent]' (or kafka_client='kafka-python')"
        )
    return ck


class ConfluentBus(KafkaBus):
    """A Kafka cluster as the bus, producing and consuming with confluent-kafka.

    Takes :class:`KafkaBus`'s arguments, with the same meaning; ``engine`` stays
    ``"kafka"`` (the transport), ``client`` says which library speaks it.
    """

    client = "confluent"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _require()
        super().__init__(*args, **kwargs)

    def __repr__(self) -> str:
        return "Confluent" + super().__repr__()

    def _rdkafka_config(self) -> dict[str, Any]:
        """:meth:`KafkaBus._config` in librdkafka's names; the password stays masked in reprs."""
        config = librdkafka_options(self._config())
        servers = self.bootstrap_servers
        config["bootstrap.servers"] = servers if isinstance(servers, str) else ",".join(servers)
        config["logger"] = log  # librdkafka's own log lines into logging, not raw stderr
        return config

    def _build(self, what: str, factory: Any, *args: Any) -> Any:
        try:
            return factory(*args)
        except ck.KafkaException as exc:
            raise BusError(
                f"cannot open a Kafka {what} on {self.bootstrap_servers!r}: {exc}"
            ) from exc

    def producer(self) -> Producer:
        config = {
            **self._rdkafka_config(),
            "enable.idempotence": True,
            "acks": "all",
            "partitioner": "murmur2_random",  # kafka-python's and the Java client's choice for keys
            # librdkafka has no "send now" but flush(), which waits, and lifts the linger only
            # while it runs: flush(0) mostly returns before the broker thread looks (a probe
            # here: 5 of 6 such records still waited a 500 ms linger). A short linger lets
            # send_now() just not wait; the C threads batch what a worker publishes meanwhile.
            "linger.ms": SEND_LINGER_MS if self.linger_ms is None else self.linger_ms,
            "message.max.bytes": self.max_message_bytes,
            "delivery.report.only.error": True,  # no Python call per acknowledged record
        }
        return self._build("producer", ConfluentProducer, config)

    def consumer(
        self,
        group: str,
        topics: Iterable[str],
        *,
        from_beginning: bool = True,
        on_assign: RebalanceCallback | None = None,
        on_revoke: RebalanceCallback | None = None,
    ) -> Consumer:
        config = {
            **self._rdkafka_config(),
            **librdkafka_options(self._membership(group)),
            # A snapshot record can be max_message_bytes; the fetch must hold it.
            "receive.message.max.bytes": max(100_000_000, self.max_message_bytes + 1_000_000),
            **librdkafka_options(self.consumer_options),
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest" if from_beginning else "latest",
        }
        return self._build(
            "consumer", ConfluentConsumer, config, list(topics), on_assign, on_revoke
        )


class ConfluentProducer(Producer):
    """Idempotent producer; ``flush`` raises :class:`DeliveryError` naming each topic that lost records.

    Only failed deliveries call back into Python (``delivery.report.only.error``):
    the usual batch costs one C call per record and one flush.
    """

    def __init__(self, config: dict[str, Any]):
        self._failed: dict[str, tuple[int, str]] = {}
        self._topics: set[str] = set()  # published to since the last flush (named on a timeout)
        self._lock = threading.Lock()
        self._producer = ck.Producer({**config, "on_delivery": self._on_delivery})
        self._produce = self._producer.produce

    def _on_delivery(self, err: Any, msg: Any) -> None:
        if err is None:
            return
        with self._lock:
            topic = msg.topic()
            count, first = self._failed.get(topic, (0, str(err)))
            self._failed[topic] = (count + 1, first)

    def publish(
        self,
        topic: str,
        value: bytes,
        key: str | bytes | None = None,
        headers: Headers | None = None,
    ) -> None:
        key = as_key(key)
        self._topics.add(topic)
        while True:
            try:
                if headers:
                    self._produce(topic, value, key, headers=[(k, bytes(v)) for k, v in headers])
                else:
                    self._produce(topic, value, key)
                return
            except BufferError:
                # librdkafka's local queue is full (queue.buffering.max.*): let it drain.
                self._producer.poll(0.05)
            except ck.KafkaException as exc:
                raise DeliveryError(f"could not publish to topic {topic!r}: {exc}") from exc

    def flush(self, timeout: float | None = None) -> None:
        left = self._producer.flush(-1 if timeout is None else timeout)
        with self._lock:
            failed, self._failed = self._failed, {}
            topics, self._topics = self._topics, set()
        still = (
            [
                f"{left} record(s) still unacknowledged after {timeout}s (published to {sorted(topics)})"
            ]
            if left
            else []
        )
        if failed or still:
            raise undelivered(failed, *still)

    def send_now(self) -> None:
        # The linger (SEND_LINGER_MS by default) sends them; flush(0) lifts it for the broker
        # threads that happen to look at once, and serves the delivery reports of failures.
        self._producer.flush(0)
        with self._lock:
            failed, self._failed = self._failed, {}
        if failed:  # reported once: the worker stops on it, and flush() need not say it again
            raise undelivered(failed)

    def unacknowledged(self) -> int:
        return len(self._producer)  # queued, in flight, or with a delivery report not yet served

    def close(self) -> None:
        self.flush()


def _record(m: Any) -> Record:
    headers = m.headers()
    _, timestamp = m.timestamp()
    return Record(
        m.topic(),
        m.partition(),
        m.offset(),
        m.key(),
        m.value(),
        tuple((k, v if v is not None else b"") for k, v in headers) if headers else (),
        timestamp if timestamp > 0 else 0,
    )


class ConfluentConsumer(Consumer):
    """A group member on librdkafka; commits only when told to, and only what it polled.

    Rebalance callbacks run inside :meth:`poll`, as with kafka-python. A
    :meth:`seek` made from ``on_assign`` becomes the starting offset of the
    assignment itself: librdkafka cannot seek a partition it is not yet fetching.
    """

    def __init__(
        self,
        config: dict[str, Any],
        topics: list[str],
        on_assign: RebalanceCallback | None,
        on_revoke: RebalanceCallback | None,
    ):
        self.on_assign, self.on_revoke = on_assign, on_revoke
        self._assigning: dict[tuple[str, int], int] | None = (
            None  # seeks asked for inside on_assign
        )
        self._gained: set[tuple[str, int]] = set()
        self._consumer = ck.Consumer(config)
        try:
            self._consumer.subscribe(
                topics, on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._revoked
            )
        except BaseException:
            self._consumer.close()
            raise

    # -- rebalances (on the polling thread, inside poll) ------------------------
    def _assigned(self, consumer: Any, partitions: list[Any]) -> None:
        gained = {(tp.topic, tp.partition) for tp in partitions}
        self._gained, self._assigning = gained, {}
        try:
            if gained and self.on_assign is not None:
                self.on_assign(gained)
            seeks = self._assigning
        finally:
            self._assigning, self._gained = None, set()
        consumer.assign(
            [
                ck.TopicPartition(
                    tp.topic, tp.partition, seeks.get((tp.topic, tp.partition), ck.OFFSET_INVALID)
                )
                for tp in partitions
            ]
        )

    def _revoked(self, consumer: Any, partitions: list[Any]) -> None:
        lost = {(tp.topic, tp.partition) for tp in partitions}
        try:
            # Also on close, as kafka-python (>= 3) does: the owner saves what it holds while it still owns it.
            if lost and self.on_revoke is not None:
                self.on_revoke(lost)
        finally:
            consumer.unassign()

    # -- the Consumer interface -------------------------------------------------
    def poll(self, max_records: int = 500, timeout: float = 1.0) -> list[Record]:
        # consume() waits until it has max_records or the timeout passed; the
        # contract is "at most timeout for the first": wait for one, take what is ready.
        try:
            first = self._consumer.poll(max(0.0, timeout))
            if first is None:
                return []
            messages = [first]
            if max_records > 1:
                messages += self._consumer.consume(max_records - 1, 0)
        except ck.KafkaException as exc:
            raise BusError(f"poll failed: {exc}") from exc
        records = []
        for m in messages:
            err = m.error()
            if err is None:
                records.append(_record(m))
            elif err.code() == ck.KafkaError.UNKNOWN_TOPIC_OR_PART and not err.fatal():
                log.warning("consumer: %s (waiting for the topic to appear)", err.str())
            elif err.code() != ck.KafkaError._PARTITION_EOF:
                raise BusError(f"poll failed on {m.topic()!r}: {err.str()}")
        return records

    def commit(self, offsets: Mapping[tuple[str, int], int] | None = None) -> None:
        try:
            if offsets is None:
                positions = [
                    tp
                    for tp in self._consumer.position(self._consumer.assignment())
                    if tp.offset >= 0
                ]
            else:
                positions = [
                    ck.TopicPartition(topic, partition, offset)
                    for (topic, partition), offset in offsets.items()
                ]
            if positions:
                self._consumer.commit(offsets=positions, asynchronous=False)
        except ck.KafkaException as exc:
            if exc.args and getattr(exc.args[0], "code", lambda: None)() in _GROUP_MOVED_ON:
                raise CommitRefused(
                    f"commit refused, the group moved on (the records will be delivered "
                    f"again): {exc}"
                ) from exc
            raise BusError(f"commit failed (the records will be delivered again): {exc}") from exc

    def assignment(self) -> set[tuple[str, int]]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Only on an owned partition (ValueError otherwise), e.g. from ``on_assign``."""
        if self._assigning is not None:
            if (topic, partition) not in self._gained:
                raise ValueError(f"{topic}[{partition}] is not being assigned to this member")
            self._assigning[(topic, partition)] = offset
            return
        if (topic, partition) not in self.assignment():
            raise ValueError(f"{topic}[{partition}] is not assigned to this member")
        tp = ck.TopicPartition(topic, partition, offset)
        for attempt in range(50):
            try:
                self._consumer.seek(tp)
                return
            except ck.KafkaException as exc:
                # _STATE: assigned but not fetching yet (just after a rebalance); it starts within ms.
                if exc.args[0].code() != ck.KafkaError._STATE or attempt == 49:
                    raise BusError(f"seek to {topic}[{partition}]@{offset} failed: {exc}") from exc
                time.sleep(0.01)

    def close(self) -> None:
        self._consumer.close()
