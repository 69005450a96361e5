"""The embedded bus keeps memory bounded: retention behind its consumer groups, plus a cap.

A trainer's embedded pipeline publishes several records per step for as long
as the run lasts; without retention every one of them stays in memory (the
trainer's RSS grew ~11 KiB per step). Offsets stay absolute, as on Kafka: a
trimmed record's offset is never reused, and a consumer that asks for one is
moved to the earliest (or latest) record, as Kafka's ``auto_offset_reset`` does.
"""

from __future__ import annotations

import pytest

from spikeguard.bus.embedded import EmbeddedBus
from spikeguard.runtime import make_bus
from spikeguard.settings import load_settings


def publish(bus: EmbeddedBus, topic: str, count: int, start: int = 0, key: str = "run") -> None:
    producer = bus.producer()
    for i in range(start, start + count):
        producer.publish(topic, str(i).encode(), key=key)


def consume_all(consumer, expected: int) -> list:
    records: list = []
    for _ in range(expected + 10):
        batch = consumer.poll(max_records=500, timeout=0.01)
        if not batch:
            break
        records += batch
    return records


def held(bus: EmbeddedBus, topic: str) -> int:
    """Records the bus holds in memory for ``topic`` (every partition)."""
    return bus.retained(topic)


def test_a_consumed_log_does_not_grow_without_bound() -> None:
    bus = EmbeddedBus(partitions=1, keep_consumed=100, max_records=None)
    bus.create_topics(["steps"])
    consumer = bus.consumer("detector", ["steps"])
    for round_ in range(20):
        publish(bus, "steps", 1000, start=round_ * 1000)
        got = consume_all(consumer, 1000)
        assert [int(r.value) for r in got] == list(range(round_ * 1000, (round_ + 1) * 1000))
        consumer.commit()
    # 20,000 published and consumed: at most what is kept behind the commit, plus one trim's slack.
    assert held(bus, "steps") <= 2 * 100
    # Offsets are absolute: the next record is offset 20,000, not a reused one.
    publish(bus, "steps", 1, start=20_000)
    [last] = consume_all(consumer, 1)
    assert last.offset == 20_000 and last.value == b"20000"


def test_the_slowest_group_holds_retention() -> None:
    bus = EmbeddedBus(partitions=1, keep_consumed=0, max_records=None)
    bus.create_topics(["steps"])
    fast, slow = bus.consumer("fast", ["steps"]), bus.consumer("slow", ["steps"])
    publish(bus, "steps", 5000)
    consume_all(fast, 5000)
    fast.commit()
    assert held(bus, "steps") == 5000  # "slow" has committed nothing: nothing may go
    got = slow.poll(max_records=1200, timeout=0.01)
    slow.commit()
    assert (
        held(bus, "steps") <= 5000 - 1200 + 1200 // 2
    )  # trimmed up to slow's commit (give or take a chunk)
    rest = consume_all(slow, 3800)
    assert [int(r.value) for r in got + rest] == list(range(5000))  # slow lost nothing


def test_the_cap_bounds_a_log_nobody_reads_and_a_lagging_group_restarts_at_the_earliest() -> None:
    bus = EmbeddedBus(partitions=1, keep_consumed=0, max_records=1000)
    bus.create_topics(["dlq"])
    lagging = bus.consumer("lagging", ["dlq"])
    assert lagging.poll(timeout=0.01) == []
    publish(bus, "dlq", 10_000)
    assert held(bus, "dlq") <= 2 * 1000
    got = consume_all(lagging, 2000)
    # Like Kafka with auto_offset_reset=earliest: the records still held, from the earliest on.
    assert got and got[-1].offset == 9999 and got[-1].value == b"9999"
    assert [r.offset for r in got] == list(range(got[0].offset, 10_000))
    assert got[0].offset >= 10_000 - 2 * 1000
    assert bus.beginning_offset("dlq", 0) == got[0].offset


def test_a_seek_to_a_trimmed_offset_resumes_at_the_earliest_or_latest() -> None:
    bus = EmbeddedBus(partitions=1, keep_consumed=0, max_records=100)
    bus.create_topics(["t"])
    reader = bus.consumer("reader", ["t"])  # a reader that has not committed: the cap alone trims
    reader.assignment()
    publish(bus, "t", 1000)
    earliest = bus.beginning_offset("t", 0)
    assert 0 < earliest <= 900
    reader.seek("t", 0, 5)
    first = reader.poll(max_records=1, timeout=0.01)
    assert [r.offset for r in first] == [earliest]
    tail = bus.consumer("tail", ["t"], from_beginning=False)
    tail.assignment()
    tail.seek("t", 0, 5)
    assert tail.poll(timeout=0.01) == []
    publish(bus, "t", 1, start=1000)
    assert [r.value for r in tail.poll(timeout=0.01)] == [b"1000"]


def test_compacted_topics_keep_the_latest_per_key_across_trims() -> None:
    bus = EmbeddedBus(partitions=1, keep_consumed=0, max_records=None)
    bus.create_topics(["state"], compacted=True)
    for i in range(10_000):
        bus.producer().publish("state", str(i).encode(), key=f"run-{i % 3}")
    records = bus.read_all("state")
    assert sorted(int(r.value) for r in records) == [9997, 9998, 9999]
    assert sorted(r.offset for r in records) == [9997, 9998, 9999]
    assert held(bus, "state") <= 100  # replaced records leave no holes behind


def test_read_all_returns_what_is_held_with_absolute_offsets() -> None:
    bus = EmbeddedBus(partitions=1, keep_consumed=10, max_records=None)
    bus.create_topics(["t"])
    consumer = bus.consumer("g", ["t"])
    publish(bus, "t", 1000)
    consume_all(consumer, 1000)
    consumer.commit()
    held_records = bus.read_all("t")
    assert held_records[-1].offset == 999
    assert [r.offset for r in held_records] == list(range(held_records[0].offset, 1000))
    assert len(held_records) < 1000


def test_unconfigured_bus_keeps_everything() -> None:
    """A bus made directly (backtests, tests, replays) keeps every record, as before."""
    bus = EmbeddedBus(partitions=1)
    bus.create_topics(["t"])
    consumer = bus.consumer("g", ["t"])
    publish(bus, "t", 5000)
    consume_all(consumer, 5000)
    consumer.commit()
    assert len(bus.read_all("t")) == 5000


def test_a_trainers_runtime_bus_has_retention_from_settings() -> None:
    bus = make_bus(
        load_settings({"embedded_keep_consumed": 50, "embedded_max_records": 5000}, env={})
    )
    assert isinstance(bus, EmbeddedBus)
    assert (bus.keep_consumed, bus.max_records) == (50, 5000)
    defaults = make_bus(load_settings(env={}))
    assert defaults.keep_consumed is not None and defaults.max_records is not None


@pytest.mark.parametrize(
    "name, value", [("embedded_keep_consumed", -1), ("embedded_max_records", 0)]
)
def test_retention_settings_are_validated(name: str, value: int) -> None:
    from spikeguard.errors import ConfigError

    with pytest.raises(ConfigError, match=name):
        load_settings({name: value}, env={})


def test_a_published_event_reaches_consumers_without_a_decode() -> None:
    """The trainer's publisher hands the embedded bus the event with its bytes: nobody decodes it again."""
    from spikeguard.producers.publisher import BackgroundPublisher
    from spikeguard.schemas import StepEvent, encode

    bus = EmbeddedBus(partitions=1)
    consumer = bus.consumer("detector", ["steps"])
    publisher = BackgroundPublisher(bus.producer(), "run-1", threaded=False)
    event = StepEvent(run_id="run-1", step=7, loss=1.5)
    publisher.submit("steps", None, event)
    [record] = consumer.poll(timeout=0.1)
    assert record.cached(StepEvent) is event
    assert record.value == encode(event)


def test_a_topic_no_group_reads_keeps_keep_consumed_records() -> None:
    """The decisions the child layout forwards to the trainer's bus are read by nobody in most runs:
    without a group to commit, they were held up to the cap (~1 KiB per step of trainer memory)."""
    bus = EmbeddedBus(partitions=1, keep_consumed=100, max_records=100_000)
    bus.create_topics(["decisions"])
    publish(bus, "decisions", 20_000)
    assert held(bus, "decisions") <= 2 * 100
    # What is held is the newest, offsets absolute, and a reader who comes late still gets it.
    late = bus.consumer("late", ["decisions"])
    got = consume_all(late, 200)
    assert got and got[-1].offset == 19_999
    assert [r.offset for r in got] == list(range(got[0].offset, 20_000))


def test_a_group_that_has_committed_but_has_no_member_still_holds_its_records() -> None:
    bus = EmbeddedBus(partitions=1, keep_consumed=0, max_records=None)
    bus.create_topics(["steps"])
    worker = bus.consumer("worker", ["steps"])
    publish(bus, "steps", 100)
    consume_all(worker, 100)
    worker.commit()
    worker.close()
    publish(bus, "steps", 1000, start=100)
    assert held(bus, "steps") >= 1000  # a restarting worker resumes at its commit
