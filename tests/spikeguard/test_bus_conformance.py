"""One contract, two engines: every test here runs on the embedded bus and on Kafka.

The Kafka half needs the local broker (``scripts/kafka_local.sh start``); see
the ``kafka_bootstrap`` fixture in tests/conftest.py for what happens without
one. Each test uses its own topics and groups, so tests never see each other's
records.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter, defaultdict
from typing import Iterator

import pytest
from pydantic import SecretStr

from spikeguard.bus.base import Bus, Consumer, Producer, Record
from spikeguard.bus.embedded import EmbeddedBus
from spikeguard.bus.confluent import ConfluentBus
from spikeguard.bus.kafka import KafkaBus
from spikeguard.errors import DeliveryError

PARTITIONS = 4
# Rebalances in seconds, not tens of seconds: members notice a join within a
# heartbeat. 6 s is the smallest session a default broker accepts.
FAST_GROUPS = {
    "session_timeout_ms": 6000,
    "heartbeat_interval_ms": 200,
    "max_poll_interval_ms": 20000,
}


@pytest.fixture(
    params=[
        "embedded",
        pytest.param("kafka", marks=pytest.mark.kafka),
        pytest.param("confluent", marks=pytest.mark.kafka),
    ]
)
def bus(request: pytest.FixtureRequest) -> Iterator[Bus]:
    if request.param == "embedded":
        engine: Bus = EmbeddedBus(partitions=PARTITIONS)
    else:
        bootstrap = request.getfixturevalue("kafka_bootstrap")
        kind = ConfluentBus if request.param == "confluent" else KafkaBus
        engine = kind(
            bootstrap,
            client_id="spikeguard-tests",
            partitions=PARTITIONS,
            consumer_options=FAST_GROUPS,
        )
    with engine:
        yield engine


_created_on_kafka: list[tuple[str, str]] = []  # (bootstrap, topic), deleted when the module ends


@pytest.fixture(scope="module", autouse=True)
def _delete_kafka_topics():
    """Leave the shared broker as we found it, so repeated runs do not pile up partitions."""
    yield
    from kafka import KafkaAdminClient

    by_broker: dict[str, list[str]] = defaultdict(list)
    for bootstrap, topic in _created_on_kafka:
        by_broker[bootstrap].append(topic)
    _created_on_kafka.clear()
    for bootstrap, topics in by_broker.items():
        with contextlib.suppress(Exception), KafkaAdminClient(bootstrap_servers=bootstrap) as admin:
            admin.delete_topics(topics)


@pytest.fixture
def stack():
    """Closes the producers and consumers a test opens, last first."""
    with contextlib.ExitStack() as exit_stack:
        yield exit_stack


def unique(prefix: str) -> str:
    return f"test-{prefix}-{uuid.uuid4().hex[:12]}"


def new_topic(bus: Bus, prefix: str = "topic") -> str:
    name = unique(prefix)
    if isinstance(bus, KafkaBus):
        _created_on_kafka.append((bus.bootstrap_servers, name))
    bus.create_topics([name])
    return name


def open_consumer(
    stack: contextlib.ExitStack, bus: Bus, group: str, topic: str, **kwargs
) -> Consumer:
    consumer = bus.consumer(group, [topic], **kwargs)
    stack.callback(consumer.close)
    return consumer


def publish(
    bus: Bus, topic: str, items: list[tuple[str | bytes | None, bytes]], headers=None
) -> None:
    producer = bus.producer()
    try:
        for key, value in items:
            producer.publish(topic, value, key=key, headers=headers)
        producer.flush(timeout=30)
    finally:
        producer.close()


def keyed(keys: int, per_key: int) -> list[tuple[str, bytes]]:
    """``per_key`` records for each of ``keys`` keys, interleaved; value ``key:seq``."""
    return [(f"run-{k}", f"run-{k}:{s}".encode()) for s in range(per_key) for k in range(keys)]


def drain(
    consumer: Consumer, count: int, timeout: float = 30.0, max_records: int = 500
) -> list[Record]:
    """Poll until ``count`` records arrived; fail after ``timeout`` seconds."""
    records: list[Record] = []
    deadline = time.monotonic() + timeout
    while len(records) < count:
        assert time.monotonic() < deadline, f"got {len(records)} of {count} records in {timeout}s"
        records += consumer.poll(max_records=max_records, timeout=0.5)
    return records


def wait_assigned(consumers: list[Consumer], topic: str, timeout: float = 90.0) -> None:
    """Poll every member until the group's partitions are split among all of them.

    On Kafka a member learns of a rebalance only on a heartbeat or poll, and one
    that joins late can take a few session timeouts to settle on a loaded
    machine: a generous deadline, since the test is about the split, not its speed."""
    everything = {(topic, p) for p in range(PARTITIONS)}
    deadline = time.monotonic() + timeout
    while True:
        owned = [c.assignment() for c in consumers]
        if (
            all(owned)
            and sum(len(o) for o in owned) == PARTITIONS
            and set().union(*owned) == everything
        ):
            return
        assert time.monotonic() < deadline, f"assignments never settled: {owned}"
        for consumer in consumers:
            assert consumer.poll(timeout=0.2) == [], "no records were published yet"


def assert_order_per_key(records: list[Record]) -> None:
    seqs: dict[bytes, list[int]] = defaultdict(list)
    partitions: dict[bytes, set[int]] = defaultdict(set)
    for r in records:
        seqs[r.key].append(int(r.value.split(b":")[1]))
        partitions[r.key].add(r.partition)
    for key, seen in seqs.items():
        assert seen == sorted(seen), f"key {key!r} out of order"
        assert len(partitions[key]) == 1, f"key {key!r} spread over partitions {partitions[key]}"


def test_order_per_key_is_preserved(bus: Bus, stack: contextlib.ExitStack) -> None:
    topic = new_topic(bus)
    items = keyed(keys=25, per_key=40)
    publish(bus, topic, items)

    records = drain(open_consumer(stack, bus, unique("group"), topic), len(items))

    assert sorted(r.value for r in records) == sorted(v for _, v in items)
    assert_order_per_key(records)
    for key in {r.key for r in records}:
        assert [int(r.value.split(b":")[1]) for r in records if r.key == key] == list(range(40))


def test_group_offsets_survive_a_consumer_restart(bus: Bus, stack: contextlib.ExitStack) -> None:
    topic, group = new_topic(bus), unique("group")
    items = keyed(keys=10, per_key=20)
    publish(bus, topic, items)

    first = open_consumer(stack, bus, group, topic)
    committed = drain(first, 1, max_records=30)
    first.commit()
    uncommitted = drain(first, 1, max_records=30)
    first.close()

    second = open_consumer(stack, bus, group, topic)
    rest = drain(second, len(items) - len(committed))
    assert second.poll(timeout=0.5) == []

    rest_values = Counter(r.value for r in rest)
    assert max(rest_values.values()) == 1, "a record came twice to the same member"
    assert set(rest_values) == {v for _, v in items} - {r.value for r in committed}
    assert {r.value for r in uncommitted} <= set(rest_values), (
        "uncommitted records must be redelivered"
    )


def test_two_members_split_the_partitions(bus: Bus, stack: contextlib.ExitStack) -> None:
    topic, group = new_topic(bus), unique("group")
    members = [open_consumer(stack, bus, group, topic) for _ in range(2)]
    wait_assigned(members, topic)
    owned = [m.assignment() for m in members]
    assert not owned[0] & owned[1]

    items = keyed(keys=40, per_key=10)
    publish(bus, topic, items)
    got: list[list[Record]] = [[], []]
    deadline = time.monotonic() + 30
    while sum(map(len, got)) < len(items):
        assert time.monotonic() < deadline, f"got {sum(map(len, got))} of {len(items)} records"
        for member, into in zip(members, got):
            batch = member.poll(timeout=0.2)
            if batch:
                into += batch
                member.commit()
    for member in members:
        assert member.poll(timeout=0.3) == []

    assert [m.assignment() for m in members] == owned, "the group rebalanced while consuming"
    for mine, into in zip(owned, got):
        assert into, "both members should get records"
        assert {(r.topic, r.partition) for r in into} <= mine
    counts = Counter(r.value for into in got for r in into)
    assert set(counts) == {v for _, v in items} and set(counts.values()) == {1}


def test_empty_poll_waits_about_the_timeout(bus: Bus, stack: contextlib.ExitStack) -> None:
    topic = new_topic(bus)
    consumer = open_consumer(stack, bus, unique("group"), topic)
    wait_assigned([consumer], topic)

    for timeout in (1.0, 0.3):
        started = time.monotonic()
        assert consumer.poll(timeout=timeout) == []
        elapsed = time.monotonic() - started
        assert 0.5 * timeout <= elapsed <= timeout + 3.0, (
            f"poll(timeout={timeout}) took {elapsed:.2f}s"
        )


def test_a_large_batch_arrives_whole_and_in_order(bus: Bus, stack: contextlib.ExitStack) -> None:
    topic = new_topic(bus)
    items = keyed(keys=100, per_key=200)  # 20,000 records
    publish(bus, topic, items)

    records = drain(
        open_consumer(stack, bus, unique("group"), topic), len(items), timeout=45, max_records=5000
    )

    assert len(records) == len(items)
    assert Counter(r.value for r in records) == Counter(v for _, v in items)
    assert_order_per_key(records)


def test_keys_and_headers_round_trip(bus: Bus, stack: contextlib.ExitStack) -> None:
    topic = new_topic(bus)
    headers = [("schema", b"1"), ("trace", b"\x00\xff"), ("trace", b"second"), ("empty", b"")]
    producer = bus.producer()
    stack.callback(producer.close)
    producer.publish(topic, b"text-key", key="run-\u00e9", headers=headers)
    producer.publish(topic, b"bytes-key", key=b"\x00\x01binary")
    producer.publish(topic, b"no-key")
    producer.publish(topic, bytes(range(256)), key="binary-value")
    producer.flush(timeout=30)

    records = {r.value: r for r in drain(open_consumer(stack, bus, unique("group"), topic), 4)}

    assert records[b"text-key"].key == "run-\u00e9".encode()
    assert records[b"text-key"].key_text == "run-\u00e9"
    assert records[b"text-key"].headers == tuple(headers)
    assert records[b"bytes-key"].key == b"\x00\x01binary"
    assert records[b"bytes-key"].headers == ()
    assert records[b"no-key"].key is None and records[b"no-key"].key_text is None
    assert records[bytes(range(256))].key == b"binary-value"
    for r in records.values():
        assert r.topic == topic and 0 <= r.partition < PARTITIONS and r.offset >= 0


def test_read_all_returns_every_record_outside_any_group(
    bus: Bus, stack: contextlib.ExitStack
) -> None:
    topic = new_topic(bus)
    items = keyed(keys=30, per_key=10)
    publish(bus, topic, items)

    records = bus.read_all(topic, timeout=20)

    assert Counter(r.value for r in records) == Counter(v for _, v in items)
    assert_order_per_key(records)
    assert bus.read_all(unique("missing")) == []
    # Reading touched no group: a new group still starts at the beginning.
    assert len(drain(open_consumer(stack, bus, unique("group"), topic), len(items))) == len(items)


def test_seek_rereads_a_partition_from_an_offset(bus: Bus, stack: contextlib.ExitStack) -> None:
    topic = new_topic(bus)
    publish(bus, topic, [("one-run", f"one-run:{i}".encode()) for i in range(100)])
    consumer = open_consumer(stack, bus, unique("group"), topic)
    first = drain(consumer, 100)
    partition = first[0].partition
    assert [r.offset for r in first] == list(range(100))

    consumer.seek(topic, partition, 60)
    again = drain(consumer, 40)

    assert [(r.partition, r.offset) for r in again] == [(partition, o) for o in range(60, 100)]
    assert [r.value for r in again] == [f"one-run:{i}".encode() for i in range(60, 100)]
    with pytest.raises(ValueError):
        consumer.seek(topic, PARTITIONS + 1, 0)  # not a partition this member owns


def test_seek_from_on_assign_resumes_where_a_snapshot_says(
    bus: Bus, stack: contextlib.ExitStack
) -> None:
    topic = new_topic(bus)
    publish(bus, topic, [("one-run", f"one-run:{i}".encode()) for i in range(100)])
    partition = bus.read_all(topic)[0].partition
    snapshot = {(topic, partition): 70}
    consumer: Consumer | None = None

    def restore(gained: set[tuple[str, int]]) -> None:
        for tp in gained & snapshot.keys():
            consumer.seek(*tp, snapshot[tp])

    consumer = open_consumer(stack, bus, unique("group"), topic, on_assign=restore)
    records = drain(consumer, 30)

    assert [r.offset for r in records] == list(range(70, 100))
    assert consumer.poll(timeout=0.3) == []


def test_on_assign_gets_the_partitions_before_their_records(
    bus: Bus, stack: contextlib.ExitStack
) -> None:
    topic = new_topic(bus)
    publish(bus, topic, keyed(keys=20, per_key=2))
    assigned: list[set[tuple[str, int]]] = []
    consumer = open_consumer(stack, bus, unique("group"), topic, on_assign=assigned.append)

    records = drain(consumer, 40)

    assert assigned, "on_assign was never called"
    assert set().union(*assigned) == {(topic, p) for p in range(PARTITIONS)}
    assert all(isinstance(tp, tuple) and len(tp) == 2 for calls in assigned for tp in calls)
    assert {(r.topic, r.partition) for r in records} <= set().union(*assigned)


def test_a_new_group_can_start_at_the_end(bus: Bus, stack: contextlib.ExitStack) -> None:
    topic = new_topic(bus)
    publish(bus, topic, keyed(keys=8, per_key=2))
    consumer = open_consumer(stack, bus, unique("group"), topic, from_beginning=False)
    wait_assigned([consumer], topic)
    assert consumer.poll(timeout=0.5) == []  # positions are resolved to the end by now

    later = keyed(keys=8, per_key=1)
    publish(bus, topic, [(k, b"later-" + v) for k, v in later])

    records = drain(consumer, len(later))
    assert all(r.value.startswith(b"later-") for r in records) and len(records) == len(later)


def test_deleted_records_are_gone_and_offsets_stay_absolute(
    bus: Bus, stack: contextlib.ExitStack
) -> None:
    """What retention does to a log: the front goes, offsets never move, readers resume at the earliest."""
    topic = new_topic(bus)
    publish(bus, topic, [("run-a", f"run-a:{i}".encode()) for i in range(50)])
    first = open_consumer(stack, bus, unique("group"), topic)
    [partition] = {r.partition for r in drain(first, 50)}

    bus.delete_records(topic, {partition: 30})

    fresh = drain(open_consumer(stack, bus, unique("group"), topic), 20)
    assert [r.offset for r in fresh] == list(range(30, 50))
    assert [r.value for r in fresh] == [f"run-a:{i}".encode() for i in range(30, 50)]
    assert [r.offset for r in bus.read_all(topic)] == list(range(30, 50))
    # A reader asking for a deleted offset gets the earliest left (auto_offset_reset=earliest).
    first.seek(topic, partition, 5)
    again = drain(first, 20)
    assert [r.offset for r in again] == list(range(30, 50))
    publish(bus, topic, [("run-a", b"run-a:50")])
    assert [r.offset for r in drain(first, 1)] == [50]


def test_a_state_snapshot_over_a_megabyte_round_trips(
    bus: Bus, stack: contextlib.ExitStack
) -> None:
    """Fusion's snapshot of a partition with many runs passed Kafka's default 1 MB and crashed the worker."""
    name = unique("state")
    if isinstance(bus, KafkaBus):
        _created_on_kafka.append((bus.bootstrap_servers, name))
    bus.create_topics([name], compacted=True)
    snapshot = b"{" + b"x" * (3 * 1024 * 1024) + b"}"
    publish(bus, name, [("0", snapshot)])
    [record] = bus.read_all(name, timeout=30)
    assert record.value == snapshot


# -- Kafka specifics the embedded engine has no counterpart for -----------------


def test_kafka_bus_keeps_secrets_out_of_its_repr() -> None:
    bus = KafkaBus(
        "127.0.0.1:1",
        security_protocol="SASL_SSL",
        sasl_mechanism="PLAIN",
        sasl_username="svc",
        sasl_password=SecretStr("hunter2"),
    )  # no network in __init__
    config = bus._config()
    assert "hunter2" not in repr(bus) and "hunter2" not in repr(config)
    assert config["sasl_plain_password"] == "hunter2" and config["sasl_plain_username"] == "svc"


def test_kafka_clients_try_a_broker_that_went_away_again_within_a_second() -> None:
    # kafka-python's own cap is 30 s: after a 30 s broker outage the workers came back up to
    # 34 s after the broker did (tests/integration/test_broker_outage.py prints the figure).
    assert KafkaBus("127.0.0.1:1")._config()["reconnect_backoff_max_ms"] <= 1000


KAFKA_CLIENTS = pytest.mark.parametrize(
    "kind", [KafkaBus, ConfluentBus], ids=["kafka-python", "confluent"]
)


def _small_topic(kafka_bootstrap: str) -> str:
    """A new topic whose broker refuses records over 2 KB: a send that is sure to fail."""
    from kafka import KafkaAdminClient

    topic = unique("small")
    _created_on_kafka.append((kafka_bootstrap, topic))
    with KafkaAdminClient(bootstrap_servers=kafka_bootstrap) as admin:
        admin.create_topics(
            {topic: {"num_partitions": 1, "configs": {"max.message.bytes": "2048"}}},
            wait_for_metadata=True,
        )
    return topic


@pytest.mark.kafka
@KAFKA_CLIENTS
def test_kafka_flush_names_the_topic_of_a_failed_send(
    kafka_bootstrap: str, kind: type[KafkaBus]
) -> None:
    topic = _small_topic(kafka_bootstrap)
    producer = kind(kafka_bootstrap).producer()
    try:
        producer.publish(topic, b"x" * 10_000, key="big")
        with pytest.raises(DeliveryError, match=topic):
            producer.flush(timeout=30)
    finally:
        producer.close()


def test_kafka_python_checksums_records_in_c():
    """crc32c is a dependency: without it kafka-python's CRC-32C runs in pure Python,
    at a third of the records per second (benchmarks/bench_crc32c.py)."""
    import kafka.record.util as util

    assert util._crc32c is not util.crc32c_py
    assert util.calc_crc32c(memoryview(b"123456789")) == 0xE3069283  # the CRC-32C check value


@pytest.mark.kafka
@KAFKA_CLIENTS
def test_kafka_keyed_records_land_where_kafka_python_puts_them(
    kafka_bootstrap: str, stack, kind
) -> None:
    """The producer picks a key's partition itself (cached per flush): it must be kafka-python's
    (and the Java client's) murmur2 choice, so that one run never spreads over two partitions
    whichever client wrote it."""
    from kafka import KafkaProducer

    bus = kind(kafka_bootstrap, partitions=PARTITIONS, consumer_options=FAST_GROUPS)
    ours, theirs = new_topic(bus, "ours"), new_topic(bus, "theirs")
    items = keyed(40, 3)
    publish(bus, ours, items)
    plain = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    try:
        for key, value in items:
            plain.send(theirs, value, key=key.encode())
        plain.flush(timeout=30)
    finally:
        plain.close()
    where = []
    for topic in (ours, theirs):
        records = drain(open_consumer(stack, bus, unique("g"), topic), len(items))
        where.append({r.key: r.partition for r in records})
        assert_order_per_key(records)
    assert where[0] == where[1] and len(set(where[0].values())) == PARTITIONS


def reader_and_producer(stack: contextlib.ExitStack, bus: Bus) -> tuple[str, Consumer, Producer]:
    """A new topic, a consumer already assigned to it, and a producer (both closed with ``stack``)."""
    topic = new_topic(bus)
    consumer = open_consumer(stack, bus, unique("g"), topic)
    wait_assigned([consumer], topic)
    producer = bus.producer()
    stack.callback(producer.close)
    return topic, consumer, producer


@pytest.mark.kafka
@KAFKA_CLIENTS
def test_kafka_records_wait_for_flush_and_then_go_out_whole(
    kafka_bootstrap: str, stack, kind
) -> None:
    """A worker sends (send_now) or flushes once per batch: until then its records stay in the
    producer (up to ``linger_ms``), so the batch leaves as one request per partition."""
    bus = kind(
        kafka_bootstrap, partitions=PARTITIONS, consumer_options=FAST_GROUPS, linger_ms=60_000
    )
    topic, consumer, producer = reader_and_producer(stack, bus)
    items = keyed(8, 25)
    for key, value in items:
        producer.publish(topic, value, key=key)
    assert consumer.poll(timeout=1.5) == []  # held: no flush yet, and the linger is a minute
    producer.flush(timeout=30)
    records = drain(consumer, len(items))
    assert len(records) == len(items)
    assert_order_per_key(records)


def test_send_now_delivers_without_a_flush_which_then_confirms(
    bus: Bus, stack: contextlib.ExitStack
) -> None:
    """A worker sends each batch's outputs at once and waits for their acknowledgements only at
    its checkpoint: what send_now sent reaches a consumer with no flush, and flush then
    leaves nothing unacknowledged."""
    topic, consumer, producer = reader_and_producer(stack, bus)
    first, second = keyed(8, 10), [(k, v + b"+") for k, v in keyed(8, 10)]
    for key, value in first:
        producer.publish(topic, value, key=key)
    producer.send_now()
    assert len(drain(consumer, len(first))) == len(first)
    for key, value in second:  # the next batch, while the first may still be unacknowledged
        producer.publish(topic, value, key=key)
    producer.send_now()
    assert producer.unacknowledged() <= len(first) + len(second)
    records = drain(consumer, len(second))
    assert sorted(r.value for r in records) == sorted(v for _, v in second)
    producer.flush(timeout=30)
    assert producer.unacknowledged() == 0


@pytest.mark.kafka
def test_kafka_python_send_now_beats_the_linger_and_batches_stay_whole(
    kafka_bootstrap: str, stack
) -> None:
    """kafka-python's send_now makes the queued batches sendable (its linger is a minute here), and
    only those: a worker's next batch is held again until its own send_now, so it leaves whole."""
    from spikeguard.schemas import StepEvent, decode

    bus = KafkaBus(
        kafka_bootstrap, partitions=PARTITIONS, consumer_options=FAST_GROUPS, linger_ms=60_000
    )
    topic, consumer, producer = reader_and_producer(stack, bus)
    for batch in range(3):
        events = [
            StepEvent(run_id=f"run-{r}", step=batch * 10 + s, loss=1.0, time=0.0)
            for s in range(10)
            for r in range(8)
        ]
        producer.publish_events([(topic, event) for event in events])
        assert consumer.poll(timeout=1.0) == []  # held: no send_now yet, and the linger is a minute
        producer.send_now()
        records = drain(consumer, len(events))
        assert sorted(
            (e.run_id, e.step) for e in (decode(r.value, StepEvent) for r in records)
        ) == sorted((e.run_id, e.step) for e in events)
    producer.flush(timeout=30)
    assert producer.unacknowledged() == 0


@pytest.mark.kafka
def test_kafka_python_send_now_waits_as_flush_does_when_its_internals_are_gone(
    kafka_bootstrap: str, stack
) -> None:
    """send_now reaches into kafka-python's accumulator (no public call does it): a kafka-python
    whose internals moved must cost latency, never records, and never the worker."""
    bus = KafkaBus(
        kafka_bootstrap, partitions=PARTITIONS, consumer_options=FAST_GROUPS, linger_ms=60_000
    )
    topic, consumer, producer = reader_and_producer(stack, bus)
    producer._accumulator = object()  # as if a new kafka-python had renamed what send_now uses
    for key, value in keyed(8, 10):
        producer.publish(topic, value, key=key)
    producer.send_now()  # no AttributeError: it waits for the acks instead
    assert producer.unacknowledged() == 0
    assert len(drain(consumer, 80)) == 80


@pytest.mark.kafka
@KAFKA_CLIENTS
def test_kafka_send_now_raises_once_a_send_is_known_lost(
    kafka_bootstrap: str, kind: type[KafkaBus]
) -> None:
    """send_now does not wait, but a failure it has heard of stops the caller there (a worker
    then saves nothing past it)."""
    topic = _small_topic(kafka_bootstrap)
    producer = kind(kafka_bootstrap).producer()
    try:
        producer.publish(topic, b"x" * 10_000, key="big")
        deadline = time.monotonic() + 30
        with pytest.raises(DeliveryError, match=topic):
            while time.monotonic() < deadline:
                producer.send_now()
                time.sleep(0.05)
    finally:
        producer.close()
