"""What the guard tells the bus beyond steps and acks: dead letters and rotated checkpoints."""

import time

from producers_helpers import Tiny, make_guard, train

from spikeguard.bus import EmbeddedBus
from spikeguard.schemas import CheckpointEvent, DeadLetter, Topics, decode


def test_an_undecodable_action_goes_to_the_dlq_and_training_goes_on(tmp_path):
    bus = EmbeddedBus()
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    producer = bus.producer()
    producer.publish(Topics().actions, b'{"kind": "rollback", "run_id": "r1"', key="r1")
    producer.publish(Topics().actions, b"not for me", key="another-run")
    deadline = time.monotonic() + 10
    while not bus.read_all(Topics().dlq) and time.monotonic() < deadline:
        time.sleep(0.01)
    train(guard, tiny, 20)
    guard.close()
    letters = [decode(r.value, DeadLetter) for r in bus.read_all(Topics().dlq)]
    assert len(letters) == 1  # another run's record is that run's business
    assert letters[0].source_topic == Topics().actions and letters[0].key == "r1"
    assert letters[0].error == "MalformedMessage" and "not JSON" in letters[0].reason
    assert guard.step_count == 20


def test_rotated_checkpoints_are_announced_as_deleted(tmp_path):
    bus = EmbeddedBus()
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=5, keep_checkpoints=2)
    train(guard, tiny, 31)
    guard.close()
    events = [decode(r.value, CheckpointEvent) for r in bus.read_all(Topics().checkpoints)]
    saved = [e.step for e in events if not e.deleted]
    deleted = [e.step for e in events if e.deleted]
    on_disk = sorted(info.step for info in guard.store.list())
    assert saved == [0, 5, 10, 15, 20, 25, 30]
    assert (
        sorted(deleted + on_disk) == saved
    )  # every checkpoint is either on disk or announced gone
