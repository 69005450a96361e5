"""The loop sends each batch's outputs at once and waits for their acknowledgements only at a
checkpoint (or past its backlog limit): a busy worker no longer waits a round trip per batch.
Nothing is saved or committed before every output before it is acknowledged, and a lost send
stops the worker with nothing saved past it."""

import importlib.util
from pathlib import Path

import pytest

from spikeguard.bus import EmbeddedBus
from spikeguard.bus.embedded import EmbeddedProducer
from spikeguard.errors import DeliveryError
from spikeguard.schemas import encode

# The running-sum detector and helpers of test_run_state.py (tests are not a package here).
_spec = importlib.util.spec_from_file_location(
    "run_state_helpers", Path(__file__).with_name("test_run_state.py")
)
_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_helpers)
TOPICS, drain, make_worker = _helpers.TOPICS, _helpers.drain, _helpers.make_worker
publish_steps, state_records, verdicts = (
    _helpers.publish_steps,
    _helpers.state_records,
    _helpers.verdicts,
)


class InFlight(EmbeddedProducer):
    """A producer whose records reach the bus only when acknowledged, at flush; send_now leaves
    them in flight. ``lose`` makes the next flush lose them, as a broker refusing them would."""

    def __init__(self, bus):
        super().__init__(bus)
        self.held: list[tuple] = []
        self.calls: list[str] = []
        self.most_in_flight = 0
        self.lose = False

    def publish(self, topic, value, key=None, headers=None):
        if topic == TOPICS.state("sum"):  # a state record: every output before it is acknowledged
            assert not self.held, "state written while outputs were unacknowledged"
            super().publish(topic, value, key, headers)
            return
        self.held.append((topic, value, key, headers))

    def publish_events(self, events):
        for topic, event in events:
            self.publish(topic, encode(event), key=event.run_id)

    def send_now(self):
        self.calls.append("send_now")
        self.most_in_flight = max(self.most_in_flight, len(self.held))

    def unacknowledged(self):
        return len(self.held)

    def flush(self, timeout=None):
        self.calls.append("flush")
        held, self.held = self.held, []
        if self.lose and held:
            raise DeliveryError(
                f"the broker did not acknowledge topic {held[0][0]!r}: {len(held)} record(s)"
            )
        for record in held:
            super().publish(*record)


def pipelined(bus, **kwargs):
    worker = make_worker(bus, **kwargs)
    worker._producer = InFlight(bus)
    return worker


def test_batches_are_sent_without_waiting_and_the_checkpoint_waits_first():
    bus = EmbeddedBus(partitions=1)
    publish_steps(bus, range(30))
    worker = pipelined(bus, max_records=9, snapshot_interval_s=3600)
    drain(worker)
    assert worker._producer.calls == ["send_now"] * 10  # 90 records, 9 a batch: no wait in the loop
    assert verdicts(bus) == {}  # all 90 verdicts still in flight
    worker.checkpoint()  # flushes before the state records (InFlight asserts it)
    assert worker._producer.calls[-1] == "flush"
    assert len(verdicts(bus)) == 90
    assert state_records(bus)["sum/partition/0"]["offsets"] == {TOPICS.steps: 90}


def test_the_backlog_of_unacknowledged_outputs_is_bounded():
    bus = EmbeddedBus(partitions=1)
    publish_steps(bus, range(30))
    worker = pipelined(bus, max_records=9, snapshot_interval_s=3600, max_unacked_records=20)
    drain(worker)
    # A wait whenever more than 20 are out: never more than the limit plus one batch's 9.
    assert "flush" in worker._producer.calls
    assert worker._producer.most_in_flight <= 20 + 9
    worker.checkpoint()
    assert len(verdicts(bus)) == 90


def test_zero_waits_for_every_batch():
    bus = EmbeddedBus(partitions=1)
    publish_steps(bus, range(4))
    worker = pipelined(bus, max_records=3, snapshot_interval_s=3600, max_unacked_records=0)
    drain(worker)
    assert worker._producer.calls == ["flush"] * 4 and worker._producer.most_in_flight == 0


def test_a_lost_send_stops_the_worker_before_anything_past_it_is_saved():
    reference = EmbeddedBus(partitions=1)
    publish_steps(reference, range(20))
    drain(make_worker(reference, max_records=9))
    expected = verdicts(reference)

    bus = EmbeddedBus(partitions=1)
    publish_steps(bus, range(20))
    first = pipelined(bus, max_records=9, snapshot_interval_s=0.0)  # a checkpoint after every batch
    first._producer.lose = True
    first.run()  # returns: it cannot go on
    assert isinstance(first.failure, DeliveryError)
    assert state_records(bus) == {}  # no state past the lost verdicts...
    assert (
        bus._groups.get(first.group) is None or not bus._groups[first.group].committed
    )  # ...no offsets

    second = make_worker(bus, max_records=9)  # the restart redoes them
    drain(second)
    assert verdicts(bus) == expected


@pytest.mark.parametrize("limit", [0, 10_000])
def test_verdicts_do_not_depend_on_when_acknowledgements_are_awaited(limit):
    reference = EmbeddedBus(partitions=2)
    publish_steps(reference, range(25), runs=("a", "b", "c", "d"))
    drain(make_worker(reference, max_records=7, max_unacked_records=0))
    bus = EmbeddedBus(partitions=2)
    publish_steps(bus, range(25), runs=("a", "b", "c", "d"))
    worker = pipelined(bus, max_records=7, snapshot_interval_s=0.0, max_unacked_records=limit)
    drain(worker)
    worker.checkpoint()
    assert verdicts(bus) == verdicts(reference)
