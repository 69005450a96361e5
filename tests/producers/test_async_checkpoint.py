"""Checkpoints written off the training thread: a copy in the step, one write in flight."""

from __future__ import annotations

import threading

import torch

from producers_helpers import Tiny, make_guard, train
from spikeguard.producers.async_checkpoint import AsyncSaver, SaveJob, stage
from spikeguard.producers.checkpoints import CheckpointStore
from spikeguard.schemas import CheckpointEvent, decode


class GatedStore(CheckpointStore):
    """A real store whose writes wait for the test to open a gate, and which records who wrote."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.writing = threading.Event()
        self.writers: set[str] = set()
        self.concurrent = self.most_concurrent = 0
        self._lock = threading.Lock()

    def save(self, payload, **kw):
        with self._lock:
            self.concurrent += 1
            self.most_concurrent = max(self.most_concurrent, self.concurrent)
        self.writers.add(threading.current_thread().name)
        self.writing.set()
        self.gate.wait()
        try:
            return super().save(payload, **kw)
        finally:
            with self._lock:
                self.concurrent -= 1


def _gated(guard, tmp_path) -> GatedStore:
    store = GatedStore(tmp_path / "gated", guard.run_id, guard.config.keep_checkpoints)
    guard.store = guard.saver.store = store
    return store


def test_the_write_runs_off_the_training_thread_on_a_copy_taken_in_the_step(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=5)
    store = _gated(guard, tmp_path)
    train(guard, tiny, 4)  # step 0's checkpoint is in flight, its write held at the gate
    assert store.writing.wait(10)
    assert guard.saver.in_flight is not None and guard.saver.in_flight.step == 0
    assert list(store.directory.glob("ckpt-*.pt")) == []  # the step did not wait for the disk
    store.gate.set()
    guard.saver.wait()
    assert threading.current_thread().name not in store.writers
    saved = store.load(store.newest())["model"]
    # What was saved is the state before step 0 ran, although 4 updates happened meanwhile.
    train_before = Tiny()  # same seed: the untrained model
    for name, value in train_before.model.state_dict().items():
        assert torch.equal(saved[name], value), name
    guard.close()


def test_a_save_due_while_one_is_in_flight_waits_for_it_and_is_never_dropped(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=0)
    train(guard, tiny, 2)
    guard.saver.wait()
    waits = guard.saver.waits
    store = _gated(guard, tmp_path)
    guard.checkpoints.save("periodic")  # step 2, in flight, held at the gate
    train(guard, tiny, 3)
    assert store.writing.wait(10)
    second = threading.Thread(target=guard.checkpoints.save, args=("on_demand",))
    second.start()
    # The second save cannot start while the first is being written: it waits (counted) ...
    while guard.saver.waits == waits:
        second.join(0.01)
    assert second.is_alive() and store.most_concurrent == 1
    store.gate.set()  # ... and goes ahead once the first is on disk.
    second.join(30)
    guard.saver.wait()
    assert not second.is_alive() and store.most_concurrent == 1
    assert guard.saver.waits == waits + 1 and guard.saver.wait_seconds > 0
    assert len(list(store.directory.glob("ckpt-*.pt"))) == 2
    guard.close()
    events = [decode(r.value, CheckpointEvent) for r in bus.read_all(guard.topics.checkpoints)]
    assert [(e.step, e.reason) for e in events if not e.deleted] == [
        (0, "periodic"),
        (2, "periodic"),
        (3, "on_demand"),
    ]


def test_checkpoints_are_published_only_once_on_disk(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=0)
    train(guard, tiny, 3)
    store = _gated(guard, tmp_path)
    guard.checkpoints.save("on_demand")
    assert store.writing.wait(10)
    train(guard, tiny, 5)
    guard.publisher.flush(5.0)

    def published():
        return [decode(r.value, CheckpointEvent) for r in bus.read_all(guard.topics.checkpoints)]

    assert [e.step for e in published()] == [0]  # step 3's is still being written
    store.gate.set()
    guard.close()
    assert [(e.step, e.reason) for e in published()] == [(0, "periodic"), (3, "on_demand")]
    assert store.find(published()[1].checkpoint_id) is not None


def test_a_rollback_waits_for_the_write_it_needs(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=0)
    train(guard, tiny, 4)
    store = _gated(guard, tmp_path)
    guard.checkpoints.save("periodic")  # step 4, still being written when the rollback comes
    assert store.writing.wait(10)
    expected = {k: v.clone() for k, v in tiny.model.state_dict().items()}
    train(guard, tiny, 9)
    threading.Timer(0.05, store.gate.set).start()  # the disk answers a little later
    text = guard.rollback(4)
    assert "rolled back to step 4" in text and guard.step_count == 4
    for name, value in tiny.model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    guard.close()


def test_rotation_in_the_background_still_keeps_the_newest_healthy(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(
        tiny, bus, tmp_path, checkpoint_every=2, keep_checkpoints=2, incident_window=100
    )
    guard.checkpoints.judged = None  # (rotation alone: no pulse tracking, test_late_decisions.py)

    def poison(g, data, batch):
        if g.step_count == 5:
            batch[0][:] = float("nan")

    train(guard, tiny, 16, on_step=poison)
    guard.close()
    kept = guard.store.list()
    assert [(c.step, c.healthy) for c in kept] == [(16, False), (14, False), (4, True)]
    assert not list(guard.store.directory.glob(".*.tmp"))  # every write completed atomically


def test_stage_copies_tensors_and_containers_but_keeps_module_metadata():
    model = torch.nn.Linear(3, 2)
    state = {"model": model.state_dict(), "rng": (1, [2, 3]), "n": 4}
    copied = stage(state)
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(copied["model"]["weight"], model.weight)
    assert copied["model"]._metadata == model.state_dict()._metadata
    assert copied["rng"] == (1, [2, 3]) and copied["rng"][1] is not state["rng"][1]


def test_without_async_the_save_happens_in_the_step(tmp_path):
    store = CheckpointStore(tmp_path, "r1")
    saver = AsyncSaver(store, enabled=False)
    saver.submit(
        lambda: {"x": torch.ones(2)}, SaveJob(step=1, epoch=0, healthy=True, reason="periodic")
    )
    assert store.newest() is not None and store.newest().step == 1
    [done] = saver.completed()
    assert done.info.step == 1 and done.error is None


def test_a_new_copy_reuses_the_buffers_of_the_previous_one_and_holds_the_new_values():
    model = torch.nn.Linear(3, 2)
    first = stage({"model": model.state_dict()})
    buffer = first["model"]["weight"]
    with torch.no_grad():
        model.weight.mul_(2.0)
    second = stage({"model": model.state_dict()}, first)
    assert second["model"]["weight"] is buffer  # no new allocation of the whole state
    assert torch.equal(second["model"]["weight"], model.weight)
