"""The embedded bus's own features beyond the conformance suite: recording and compaction."""

from spikeguard.bus import EmbeddedBus


def test_a_recorded_directory_reopens_with_records_and_committed_offsets(tmp_path):
    bus = EmbeddedBus(partitions=2, data_dir=tmp_path)
    producer = bus.producer()
    for i in range(10):
        producer.publish("s.steps", f"v{i}".encode(), key=f"run{i % 3}", headers=[("h", b"\x00")])
    producer.publish("s.steps", b"\xff\xfe binary", key=None)
    producer.flush()
    consumer = bus.consumer("g", ["s.steps"])
    assert len(consumer.poll(6, timeout=0)) == 6
    consumer.commit()
    consumer.close()
    bus.close()

    again = EmbeddedBus(partitions=2, data_dir=tmp_path)
    records = again.read_all("s.steps")
    assert sorted(r.value for r in records) == sorted(
        [f"v{i}".encode() for i in range(10)] + [b"\xff\xfe binary"]
    )
    assert all(r.headers == (("h", b"\x00"),) for r in records if r.value.startswith(b"v"))
    rest = again.consumer("g", ["s.steps"]).poll(100, timeout=0)
    assert len(rest) == 11 - 6  # the group goes on where it committed


def test_a_torn_last_line_keeps_everything_before_it(tmp_path):
    bus = EmbeddedBus(partitions=1, data_dir=tmp_path)
    producer = bus.producer()
    for i in range(3):
        producer.publish("t", f"v{i}".encode(), key="k")
    bus.close()
    log = tmp_path / "t" / "0.jsonl"
    log.write_text(log.read_text() + '{"o": 3, "t": 0, "v": "half')
    reopened = EmbeddedBus(partitions=1, data_dir=tmp_path)
    assert [r.value for r in reopened.read_all("t")] == [b"v0", b"v1", b"v2"]
    # The torn line is gone from the file: what comes next is not lost behind it.
    reopened.producer().publish("t", b"v3", key="k")
    reopened.close()
    assert [r.value for r in EmbeddedBus(partitions=1, data_dir=tmp_path).read_all("t")] == [
        b"v0",
        b"v1",
        b"v2",
        b"v3",
    ]


def test_a_compacted_topic_keeps_only_the_newest_value_per_key():
    bus = EmbeddedBus(partitions=1)
    bus.create_topics(["state"], compacted=True)
    producer = bus.producer()
    for i in range(100):
        producer.publish("state", str(i).encode(), key=str(i % 3))
    values = sorted(int(r.value) for r in bus.read_all("state"))
    assert values == [97, 98, 99]
    assert [r.offset for r in bus.read_all("state")] == [97, 98, 99]  # offsets never move
