"""The Kafka engine of the bus, on kafka-python (>= 3.0.11).

Nothing here touches the network in ``__init__``: :class:`KafkaBus` only
holds settings, and each client connects when :meth:`KafkaBus.producer`,
:meth:`KafkaBus.consumer`, :meth:`KafkaBus.create_topics` or
:meth:`KafkaBus.read_all` asks for one. Security settings (SASL, SSL) go to
every client; the SASL password never appears in a repr or a log line.

Partitioning is Kafka's own (murmur2 of the key, as every Kafka client
does), not :func:`spikeguard.bus.base.partition_for`: what the engines share
is that one key always lands in one partition.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterable, Mapping

from kafka import AsyncConsumerRebalanceListener, KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.future import Future
from kafka.errors import (
    CommitFailedError,
    FencedInstanceIdError,
    IllegalGenerationError,
    KafkaConnectionError,
    KafkaError,
    NodeNotReadyError,
    RebalanceInProgressError,
    TopicAlreadyExistsError,
    UnknownMemberIdError,
)
from kafka.structs import OffsetAndMetadata
from pydantic import SecretStr

from spikeguard.bus.base import Bus, Consumer, Producer, RebalanceCallback, Record
from spikeguard.bus.kafka_producer import KafkaBusProducer
from spikeguard.errors import BusError, CommitRefused

log = logging.getLogger(__name__)

__all__ = ["KafkaBus"]

#: The longest wait between two attempts to reach a broker that went away (every client this
#: bus opens). kafka-python doubles its wait up to 30 s by default, so after an outage of that
#: length a worker could stay blind for another 30 s once the broker was back; 1 s is the
#: Java client's default.
RECONNECT_BACKOFF_MAX_MS = 1000


class _SlowIOStepNote(logging.Filter):
    """kafka-python's "blocking the event loop" WARNING, explained once and then kept at DEBUG.

    kafka-python 3.x warns whenever one step of its IO thread takes more than
    0.1 s. In a worker that step waits for the GIL while the detectors
    compute on the worker thread (and for the CPU on a busy machine): the IO
    thread is delayed, nothing is lost, and heartbeats go out within their
    own, much longer, session timeout. Its threshold is not a client setting,
    so the lines are filtered here: the first is replaced by one INFO line
    saying this, the rest show only with the ``kafka`` logger at DEBUG.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or "blocking the event loop" not in str(record.msg):
            return True
        self.seen += 1
        if self.seen == 1:
            log.info(
                "kafka-python reports slow steps of its IO thread ('blocking the event loop'): "
                "in a worker that is the GIL held by the detectors or a busy CPU, not a fault; "
                "further reports go to DEBUG (logger 'kafka.net.selector')"
            )
        return logging.getLogger("kafka").isEnabledFor(logging.DEBUG)


SLOW_IO_STEPS = _SlowIOStepNote()
logging.getLogger("kafka.net.selector").addFilter(SLOW_IO_STEPS)


class _Masked(str):
    """The SASL password as kafka-python needs it (a str), shown as stars.

    kafka-python logs client configurations at DEBUG level; this keeps the
    secret out of those lines.
    """

    def __repr__(self) -> str:
        return "'**********'"


def _record(r: Any) -> Record:
    headers = r.headers  # usually empty: no generator per record then
    timestamp = r.timestamp
    return Record(
        r.topic,
        r.partition,
        r.offset,
        r.key,
        r.value,
        tuple((k, v if v is not None else b"") for k, v in headers) if headers else (),
        timestamp if timestamp is not None and timestamp >= 0 else 0,
    )


#: A poll that failed only because the broker could not be reached.
_BROKER_AWAY = (KafkaConnectionError, NodeNotReadyError)
#: A commit refused because the group went on without this member (CommitRefused).
_GROUP_MOVED_ON = (
    CommitFailedError,
    UnknownMemberIdError,
    IllegalGenerationError,
    RebalanceInProgressError,
    FencedInstanceIdError,
)


class _Listener(AsyncConsumerRebalanceListener):
    """Turns kafka-python's rebalance calls into the bus callbacks, off its IO thread.

    kafka-python 3.x runs the listener on the consumer's IO thread, where a
    blocking call on the consumer (the hand-over commit) raises "Cannot block on
    net.run() from the IO thread itself". So the listener is the async kind: it
    runs the callback on a helper thread and awaits it, which leaves the IO loop
    free to carry the callback's commit (and the group's heartbeats) meanwhile.
    The worker thread is inside ``poll`` all along, so the callback still runs
    between two of its batches, as on the embedded bus.
    """

    def __init__(self, owner: "_KafkaConsumer"):
        self._owner = owner

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        lost = {(tp.topic, tp.partition) for tp in revoked}
        if lost and self._owner.on_revoke is not None:
            await self._owner.off_the_io_thread(self._owner.on_revoke, lost)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        gained = {(tp.topic, tp.partition) for tp in assigned}
        if gained and self._owner.on_assign is not None:
            await self._owner.off_the_io_thread(self._owner.on_assign, gained)


class _KafkaConsumer(Consumer):
    """A group member; commits only when told to, and only what it polled."""

    def __init__(
        self,
        config: dict[str, Any],
        topics: list[str],
        on_assign: RebalanceCallback | None,
        on_revoke: RebalanceCallback | None,
    ):
        self.on_assign, self.on_revoke = on_assign, on_revoke
        self._broker_away = False  # a poll failed to reach the broker, and none has since succeeded
        self._consumer = KafkaConsumer(**config)
        try:
            self._consumer.subscribe(topics=topics, listener=_Listener(self))
            # Learn the topics' partitions before the first join: a group leader
            # that joins without them assigns nothing, and kafka-python may not
            # notice until its next periodic metadata refresh (metadata_max_age_ms).
            for topic in topics:
                self._consumer.partitions_for_topic(topic)
        except BaseException:
            self._consumer.close(autocommit=False)
            raise

    async def off_the_io_thread(
        self, callback: RebalanceCallback, partitions: set[tuple[str, int]]
    ) -> None:
        """Run ``callback(partitions)`` on a helper thread and wait for it without blocking the IO loop."""
        net = self._consumer._net  # kafka-python 3.x's IO loop: the one documented way back onto it
        done = Future()

        def run() -> None:
            try:
                callback(partitions)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the IO thread, then by poll
                net.call_soon_threadsafe(
                    lambda error=exc: done.failure(error)
                )  # (exc is unbound after the block)
            else:
                net.call_soon_threadsafe(lambda: done.success(None))

        threading.Thread(target=run, name="spikeguard-rebalance", daemon=True).start()
        await done

    def poll(self, max_records: int = 500, timeout: float = 1.0) -> list[Record]:
        try:
            batches = self._consumer.poll(
                timeout_ms=max(0, int(timeout * 1000)), max_records=max_records
            )
        except KafkaError as exc:
            if exc.__cause__ is not None and not isinstance(exc.__cause__, KafkaError):
                raise exc.__cause__ from None  # a rebalance callback failed: its own error, as on the embedded bus
            if isinstance(exc, _BROKER_AWAY):
                # The broker is away (an outage, a restart): the consumer reconnects by itself,
                # and a worker that polls again meanwhile loses nothing. Said once per outage.
                if not self._broker_away:
                    log.warning(
                        "the broker is unreachable (%r); polling again until it is back", exc
                    )
                self._broker_away = True
                time.sleep(max(0.0, min(timeout, 1.0)))  # the poll's own wait, not a busy loop
                return []
            raise BusError(f"poll failed: {exc!r}") from exc
        if self._broker_away:
            log.warning("the broker is reachable again")
            self._broker_away = False
        return [_record(r) for records in batches.values() for r in records]

    def commit(self, offsets: Mapping[tuple[str, int], int] | None = None) -> None:
        try:
            if offsets is None:
                self._consumer.commit()
            elif offsets:
                self._consumer.commit(
                    {
                        TopicPartition(topic, partition): OffsetAndMetadata(offset, "", -1)
                        for (topic, partition), offset in offsets.items()
                    }
                )
        except _GROUP_MOVED_ON as exc:
            raise CommitRefused(
                f"commit refused, the group moved on (the records will be delivered again): {exc!r}"
            ) from exc
        except KafkaError as exc:
            raise BusError(f"commit failed (the records will be delivered again): {exc!r}") from exc

    def assignment(self) -> set[tuple[str, int]]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        """Only on an owned partition (ValueError otherwise), e.g. from ``on_assign``."""
        self._consumer.seek(TopicPartition(topic, partition), offset)

    def close(self) -> None:
        self._consumer.close(autocommit=False)


class KafkaBus(Bus):
    """A Kafka cluster as the bus.

    Args:
        bootstrap_servers: ``host:port`` (or several, comma-separated or a list).
        client_id: Name the broker logs for these clients.
        security_protocol: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.
        sasl_mechanism: PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, ... (SASL only).
        sasl_username / sasl_password: SASL credentials; the password is a SecretStr.
        ssl_cafile / ssl_certfile / ssl_keyfile: PEM files for SSL.
        partitions / replication_factor: Of the topics :meth:`create_topics` makes.
        instance_id: Static group membership: every consumer this bus opens
            joins its group with ``group.instance.id`` = this name (``NAME-2``,
            ... for a second consumer of the same group), so a process
            restarted under the same name takes its partitions back at once,
            without waiting for its old session to expire. Needs Kafka >= 2.3.
            The name must be unique among the live members of each group:
            a second live member under it fences the first.
        session_timeout_ms / heartbeat_interval_ms: Of every consumer group
            member (kafka-python's defaults, 45 s / 3 s, when None).
        consumer_options: Further kafka-python consumer settings; they win over the above.
        max_message_bytes: Largest record a producer sends, and the ``max.message.bytes``
            of the compacted topics :meth:`create_topics` makes: a worker's state snapshot
            (fusion's, with many runs in a partition) passes Kafka's default 1 MB.
        linger_ms: How long a producer's records may wait for a ``flush`` (or a
            ``send_now``) before they go out anyway. Every spikeguard caller flushes or
            sends at the end of its batch (the worker, the Guard's sender thread, the
            CLI tools), so this is not a delay they see: it lets a batch go out whole,
            one request per partition. None: the client's own choice, 500 ms on
            kafka-python (whose ``send_now`` sends at once), 2 ms on confluent
            (librdkafka has no call that sends without waiting: its linger is
            how long a worker's outputs wait; see spikeguard.bus.confluent).
    """

    engine = "kafka"
    client = "kafka-python"  # the library speaking Kafka (spikeguard.bus.confluent: "confluent")

    def __init__(
        self,
        bootstrap_servers: str | list[str],
        *,
        client_id: str = "spikeguard",
        security_protocol: str = "PLAINTEXT",
        sasl_mechanism: str | None = None,
        sasl_username: str | None = None,
        sasl_password: SecretStr | None = None,
        ssl_cafile: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        partitions: int = 4,
        replication_factor: int = 1,
        instance_id: str | None = None,
        session_timeout_ms: int | None = None,
        heartbeat_interval_ms: int | None = None,
        consumer_options: Mapping[str, Any] | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
        linger_ms: int | None = None,
    ):
        if isinstance(sasl_password, str):
            sasl_password = SecretStr(sasl_password)
        self.bootstrap_servers = bootstrap_servers
        self.client_id = client_id
        self.security_protocol = security_protocol
        self.sasl_mechanism = sasl_mechanism
        self.sasl_username = sasl_username
        self.sasl_password = sasl_password
        self.ssl_cafile, self.ssl_certfile, self.ssl_keyfile = ssl_cafile, ssl_certfile, ssl_keyfile
        self.partitions = partitions
        self.replication_factor = replication_factor
        self.instance_id = instance_id
        self.session_timeout_ms = session_timeout_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.consumer_options = dict(consumer_options or {})
        self.max_message_bytes = max_message_bytes
        self.linger_ms = linger_ms
        self._members: dict[str, int] = {}  # consumers opened per group (static member names)
        self._members_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"KafkaBus(bootstrap_servers={self.bootstrap_servers!r}, client_id={self.client_id!r}, "
            f"security_protocol={self.security_protocol!r}, sasl_mechanism={self.sasl_mechanism!r})"
        )

    def _config(self) -> dict[str, Any]:
        """Connection and security settings shared by every client.

        In kafka-python's names; the confluent client takes the same mapping in
        librdkafka's (:func:`spikeguard.bus.confluent.librdkafka_options`).
        """
        config: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
            "reconnect_backoff_max_ms": RECONNECT_BACKOFF_MAX_MS,
        }
        if self.sasl_mechanism is not None:
            config["sasl_mechanism"] = self.sasl_mechanism
            config["sasl_plain_username"] = self.sasl_username
            if self.sasl_password is not None:
                config["sasl_plain_password"] = _Masked(self.sasl_password.get_secret_value())
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(self, name) is not None:
                config[name] = getattr(self, name)
        return config

    def _membership(self, group: str) -> dict[str, Any]:
        """How a consumer of ``group`` takes part in it (kafka-python's names, as :meth:`_config`)."""
        membership: dict[str, Any] = {}
        if self.session_timeout_ms is not None:
            membership["session_timeout_ms"] = self.session_timeout_ms
        if self.heartbeat_interval_ms is not None:
            membership["heartbeat_interval_ms"] = self.heartbeat_interval_ms
        if self.instance_id is not None:
            membership["group_instance_id"] = self._static_member(group)
        return membership

    def _connect(self, what: str, factory: Any, *args: Any) -> Any:
        try:
            return factory(*args)
        except KafkaError as exc:
            raise BusError(
                f"cannot open a Kafka {what} on {self.bootstrap_servers!r}: {exc!r}"
            ) from exc

    def producer(self) -> Producer:
        return self._connect(
            "producer",
            KafkaBusProducer,
            self._config(),
            self.max_message_bytes,
            500 if self.linger_ms is None else self.linger_ms,
        )

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
            **self._config(),
            **self._membership(group),
            **self.consumer_options,
            "group_id": group,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest" if from_beginning else "latest",
        }
        return self._connect("consumer", _KafkaConsumer, config, list(topics), on_assign, on_revoke)

    def probe(self, timeout: float = 5.0) -> None:
        """Raise :class:`BusError` unless a broker answers a metadata request within ``timeout`` s.

        kafka-python's own clients wait 30 s or more for a first broker; a
        trainer asks this first so that a wrong address costs it seconds.
        """
        ms = max(100, int(timeout * 1000))
        try:
            admin = KafkaAdminClient(
                **self._config(), bootstrap_timeout_ms=ms, request_timeout_ms=ms
            )
        except Exception as exc:
            raise BusError(
                f"no Kafka broker answers at {self.bootstrap_servers!r} within "
                f"{timeout:g}s: {exc!r}"
            ) from exc
        try:
            if not admin.describe_cluster().get("brokers"):
                raise BusError(f"the cluster at {self.bootstrap_servers!r} reports no broker")
        except KafkaError as exc:
            raise BusError(
                f"the cluster at {self.bootstrap_servers!r} does not answer: {exc!r}"
            ) from exc
        finally:
            admin.close()

    def active_groups(self, groups: Iterable[str], timeout: float = 5.0) -> set[str]:
        """Those of ``groups`` that have at least one live member right now."""
        ms = max(100, int(timeout * 1000))
        names = list(groups)
        admin = self._connect(
            "admin client",
            lambda: KafkaAdminClient(
                **self._config(), bootstrap_timeout_ms=ms, request_timeout_ms=ms
            ),
        )
        try:
            described = admin.describe_groups(names)
        except KafkaError as exc:
            raise BusError(f"could not describe consumer groups {names}: {exc!r}") from exc
        finally:
            admin.close()
        return {name for name, info in described.items() if info.get("members")}

    def _static_member(self, group: str) -> str:
        """This bus's n-th consumer of ``group`` is ``instance_id`` (n = 1) or ``instance_id-n``.

        Numbered in the order the process opens them, which a restarted
        process repeats, so each member gets its old place back.
        """
        if self.instance_id is None:
            raise ValueError("static group membership needs the bus's instance_id")
        with self._members_lock:
            n = self._members[group] = self._members.get(group, 0) + 1
        return self.instance_id if n == 1 else f"{self.instance_id}-{n}"

    def create_topics(self, topics: Iterable[str], *, compacted: bool = False) -> None:
        names = list(dict.fromkeys(topics))
        admin = self._connect("admin client", lambda: KafkaAdminClient(**self._config()))
        try:
            missing = [t for t in names if t not in set(admin.list_topics())]
            if not missing:
                return
            configs = (
                {"cleanup.policy": "compact", "max.message.bytes": str(self.max_message_bytes)}
                if compacted
                else {}
            )
            spec = {
                t: {
                    "num_partitions": self.partitions,
                    "replication_factor": self.replication_factor,
                    "configs": configs,
                }
                for t in missing
            }
            result = admin.create_topics(spec, raise_errors=False)
            errors = {
                t["name"]: t.get("error_message") or t["error_code"]
                for t in result["topics"]
                if t["error_code"] not in (0, TopicAlreadyExistsError.errno)
            }
            if errors:
                raise BusError(f"could not create topics: {errors}")
            admin.wait_for_topics(missing, timeout_ms=30_000)
        except KafkaError as exc:
            raise BusError(f"could not create topics {names}: {exc!r}") from exc
        finally:
            admin.close()

    def delete_records(self, topic: str, before: Mapping[int, int], timeout: float = 30.0) -> None:
        admin = self._connect("admin client", lambda: KafkaAdminClient(**self._config()))
        try:
            admin.delete_records(
                {TopicPartition(topic, p): o for p, o in before.items()},
                timeout_ms=int(timeout * 1000),
            )
        except KafkaError as exc:
            raise BusError(
                f"could not delete records of {topic!r} below {dict(before)}: {exc!r}"
            ) from exc
        finally:
            admin.close()

    def read_all(self, topic: str, timeout: float = 10.0) -> list[Record]:
        deadline = time.monotonic() + timeout
        config = {
            **self._config(),
            "group_id": None,
            "enable_auto_commit": False,
            "allow_auto_create_topics": False,
            "auto_offset_reset": "earliest",
        }
        consumer = self._connect("reader", lambda: KafkaConsumer(**config))
        try:
            tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
            if not tps:
                return []
            consumer.assign(tps)
            consumer.seek_to_beginning()
            end = consumer.end_offsets(tps, timeout_ms=int(timeout * 1000))
            records: list[Record] = []
            while True:
                left = deadline - time.monotonic()
                wait_ms = max(1, int(left * 1000))
                behind = [
                    tp for tp in tps if (consumer.position(tp, timeout_ms=wait_ms) or 0) < end[tp]
                ]
                if not behind:
                    break
                if left <= 0:
                    raise BusError(
                        f"read_all({topic!r}) did not reach the end offsets {end} within {timeout}s"
                    )
                for tp, batch in consumer.poll(
                    timeout_ms=int(min(left, 0.5) * 1000), max_records=10_000
                ).items():
                    records.extend(_record(r) for r in batch if r.offset < end[tp])
            return sorted(records, key=lambda r: (r.partition, r.offset))
        except KafkaError as exc:
            raise BusError(f"read_all({topic!r}) failed: {exc!r}") from exc
        finally:
            consumer.close(autocommit=False)
