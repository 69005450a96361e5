"""Checkpoints: atomic writes, rotation that protects the newest healthy one, weights_only loads."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from spikeguard.producers import CheckpointStore, checkpoint_id, rng
from spikeguard.producers.atomic import atomic_write


def _save(store, step, healthy, epoch=0):
    return store.save({"w": torch.tensor([float(step)])}, step=step, epoch=epoch, healthy=healthy)


def test_rotation_keeps_newest_n_and_always_the_newest_healthy(tmp_path):
    store = CheckpointStore(tmp_path, "r", keep=2)
    _save(store, 0, True)
    _save(store, 10, True)
    for step in (20, 30, 40, 50):  # an incident: every later checkpoint is unhealthy
        _save(store, step, False)
    kept = [(c.step, c.healthy) for c in store.list()]
    assert kept == [(50, False), (40, False), (10, True)]
    assert store.newest_healthy().step == 10
    _save(store, 60, True)
    assert [(c.step, c.healthy) for c in store.list()] == [(60, True), (50, False)]


def test_newest_is_by_epoch_then_step(tmp_path):
    store = CheckpointStore(tmp_path, "r", keep=3)
    _save(store, 100, True, epoch=0)
    _save(store, 40, True, epoch=1)  # after a rollback: newer although an earlier step
    assert store.newest().step == 40 and store.newest().epoch == 1
    assert store.newest_healthy(max_step=50).step == 40


def test_same_step_saved_again_keeps_one_file(tmp_path):
    store = CheckpointStore(tmp_path, "r", keep=5)
    _save(store, 10, True)
    _save(store, 10, False)
    assert [(c.step, c.healthy) for c in store.list()] == [(10, False)]
    assert store.list()[0].checkpoint_id == checkpoint_id("r", 10, 0)


def test_a_crash_mid_write_leaves_the_old_file_whole(tmp_path):
    target = tmp_path / "f.pt"
    atomic_write(target, lambda h: h.write(b"old"))

    def half(handle):
        handle.write(b"half-written")
        raise OSError("disk full")
    with pytest.raises(OSError):
        atomic_write(target, half)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.pt"]


def test_stale_temp_files_are_cleaned_and_not_listed(tmp_path):
    (tmp_path / ".ckpt-e00000-s0000000010-h-c-ab.pt.x1.tmp").write_bytes(b"partial")
    store = CheckpointStore(tmp_path, "r")
    assert store.list() == [] and list(tmp_path.iterdir()) == []


def test_everything_loads_with_weights_only_including_rng(tmp_path):
    store = CheckpointStore(tmp_path, "r")
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    info = store.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                       "scheduler": sched.state_dict(), "rng": rng.capture(),
                       "guard": {"x": float("nan"), "ids": ["a", "b"]}}, step=1, epoch=0, healthy=True)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    body = store.load(info)  # torch.load(weights_only=True) inside
    rng.restore(body["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
    fresh = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    fresh.load_state_dict(body["optimizer"])
    assert body["step"] == 1 and body["healthy"] is True and body["guard"]["ids"] == ["a", "b"]


def test_rank_companion_files(tmp_path):
    main = CheckpointStore(tmp_path, "r", rank=0)
    other = CheckpointStore(tmp_path, "r", rank=1)
    info = _save(main, 10, True)
    other.save({"rng": {"tag": torch.tensor([7])}}, step=10, epoch=0, healthy=True)
    assert [c.step for c in other.list()] == [10] and [c.step for c in main.list()] == [10]
    body = other.load(other.find(info.checkpoint_id))
    assert float(body["w"]) == 10.0 and int(body["rank_state"]["rng"]["tag"]) == 7
