"""The embedded consumer: a poll waiting for records can be ended from another thread."""

from __future__ import annotations

import threading

from spikeguard.bus import EmbeddedBus


def test_wakeup_ends_a_waiting_poll_at_once_with_nothing():
    # A reader that blocks for long (no timer waking it to look for a stop) must still stop
    # promptly: wakeup() ends its poll, as a record would.
    bus = EmbeddedBus(partitions=1)
    bus.create_topics(["t"])
    consumer = bus.consumer("g", ["t"])
    got: list = []
    reader = threading.Thread(target=lambda: got.append(consumer.poll(10, timeout=60.0)))
    reader.start()
    consumer.wakeup()
    reader.join(timeout=10.0)
    assert not reader.is_alive(), "the poll waited out its timeout"
    assert got == [[]]
    bus.producer().publish("t", b"x", key="k")
    assert [r.value for r in consumer.poll(10, timeout=5.0)] == [b"x"]  # polls on normally after it
    consumer.close()
