"""Checkpoints: atomic writes, rotation that protects the newest healthy one, weights_only loads."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from spikeguard.producers import CheckpointStore, checkpoint_id, rng
from spikeguard.producers.atomic import atomic_write
from spikeguard.producers.config import ResumeMode


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
    info = store.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "rng": rng.capture(),
            "guard": {"x": float("nan"), "ids": ["a", "b"]},
        },
        step=1,
        epoch=0,
        healthy=True,
    )
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


def test_a_rank_opening_the_shared_directory_leaves_other_ranks_writes_in_flight(tmp_path):
    """Rank 0 opening its store must not delete rank 1's temp file mid-write (the flaky
    FileNotFoundError of test_distributed): each rank cleans up only its own leftovers."""
    name = f"ckpt-e00000-s0000000000-h-{checkpoint_id('r', 0)}"
    theirs = tmp_path / f".{name}.rank1.pt.k3j9x_2a.tmp"
    mine = tmp_path / f".{name}.pt.q8z1m0ab.tmp"
    ledger = tmp_path / ".spikeguard-ledger.json.a1b2c3d4.tmp"
    for tmp in (theirs, mine, ledger):
        tmp.write_bytes(b"half a checkpoint")
    CheckpointStore(tmp_path, "r", rank=0)
    assert theirs.exists() and not mine.exists() and not ledger.exists()
    CheckpointStore(tmp_path, "r", rank=1)  # rank 1's own leftover goes when rank 1 opens it
    assert not theirs.exists()


def test_a_guard_checkpoint_holds_one_entry_per_state_part(tmp_path):
    """The Guard's state is a dict of Stateful parts; the checkpoint is that dict, and
    loading it puts each part back (a user's own Stateful joins by name)."""
    from producers_helpers import Tiny, train

    from spikeguard.producers import Guard, GuardConfig

    tiny = Tiny()
    sched = torch.optim.lr_scheduler.StepLR(tiny.optimizer, step_size=3, gamma=0.5)
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        sched,
        run_id="r1",
        connect=False,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=0, resume=False),
    )
    train(guard, tiny, 4)
    guard.lr.scale_by(0.5)
    guard.clipper.set_fixed(0.3)
    event = guard.checkpoint()
    body = torch.load(event.path, weights_only=True)
    assert guard.parts.names() == [
        "model",
        "optimizer",
        "scheduler",
        "rng",
        "lr",
        "clip",
        "health",
        "ledger",
        "skip_rule",
        "data",
    ]
    assert set(guard.parts.names()) <= set(body)
    assert body["lr"]["scale"] == 0.5 and body["clip"]["max_norm"] == 0.3
    assert body["data"]["position"] == 4 and body["scheduler"]["last_epoch"] == 4
    weights = tiny.params()
    train(guard, tiny, 8)
    guard.lr.scale_by(0.1)
    guard.load_state_dict(guard.store.load(guard.store.find(event.checkpoint_id)))
    assert all(torch.equal(a, b) for a, b in zip(weights, tiny.params()))
    assert guard.lr.scale == 0.5 and sched.last_epoch == 4 and guard.loader.position == 4
    guard.close()


def test_a_finished_runs_archive_takes_the_sharded_checkpoints_directories_along(tmp_path):
    """A sharded model's checkpoint is a file plus its dcp-<id>/ directory (sharded.py):
    archiving a finished run must move both, or the file would point at nothing."""
    from spikeguard.producers import lifecycle
    from spikeguard.producers.ledger import SIDECAR

    store = CheckpointStore(tmp_path, "r", keep=3)
    info = store.save({"model": {}}, step=0, epoch=0, healthy=True)  # (its shards: made by hand)
    shards = store.shard_dir(info.checkpoint_id)
    shards.mkdir()
    (shards / "__0_0.distcp").write_bytes(b"rank 0's part")
    (tmp_path / SIDECAR).write_text("{}")
    archived = lifecycle.archive_finished(tmp_path)
    assert sorted(p.name for p in archived.iterdir()) == sorted(
        [info.path.name, store.sum_path(info.checkpoint_id).name, shards.name, SIDECAR]
    )
    assert (archived / shards.name / "__0_0.distcp").read_bytes() == b"rank 0's part"
    assert not any(p.name.startswith(("ckpt-", "dcp-")) for p in tmp_path.iterdir())


def test_a_checkpoint_whose_bytes_changed_is_refused_by_its_checksum(tmp_path):
    """The SHA-256 written with a checkpoint catches what torch.load would not: a changed byte
    inside a tensor's data (the zip's structure intact) loads silently without it."""
    import zipfile

    from spikeguard.producers.checkpoints import CheckpointUnreadable

    store = CheckpointStore(tmp_path, "r", keep=3)
    info = store.save({"w": torch.arange(64, dtype=torch.float32)}, step=5, epoch=0, healthy=True)
    assert store.load(info)["w"].sum() == 2016.0
    with zipfile.ZipFile(info.path) as z:
        entry = next(i for i in z.infolist() if "/data/" in i.filename)
    raw = bytearray(info.path.read_bytes())
    header = entry.header_offset
    at = (
        header
        + 30
        + int.from_bytes(raw[header + 26 : header + 28], "little")
        + int.from_bytes(raw[header + 28 : header + 30], "little")
        + 17
    )
    raw[at] ^= 0x40
    info.path.write_bytes(bytes(raw))
    assert torch.load(info.path, weights_only=True)["w"].sum() != 2016.0  # torch reads it as it is
    with pytest.raises(CheckpointUnreadable, match="checksum mismatch"):
        store.load(info)
    info.path.write_bytes(bytes(raw[: len(raw) // 2]))
    store.sum_path(info.checkpoint_id).unlink()  # no checksum: torch's own read error, named
    with pytest.raises(CheckpointUnreadable, match="cannot be read"):
        store.load(info)


def test_rotation_takes_a_checkpoints_checksum_along_and_a_rank_needs_its_own_file(tmp_path):
    from spikeguard.producers.checkpoints import CheckpointUnreadable

    store = CheckpointStore(tmp_path, "r", keep=1)
    first = store.save({"w": torch.zeros(2)}, step=0, epoch=0, healthy=False)
    store.save({"w": torch.ones(2)}, step=5, epoch=0, healthy=False)
    assert not first.path.exists() and not store.sum_path(first.checkpoint_id).exists()
    assert sorted(p.suffix for p in tmp_path.iterdir() if p.name.startswith("ckpt-")) == [
        ".pt",
        ".sha256",
    ]
    rank1 = CheckpointStore(tmp_path, "r", keep=1, rank=1)
    with pytest.raises(CheckpointUnreadable, match="no state of rank 1"):
        rank1.load(rank1.newest())  # rank 0's random streams are not rank 1's


def test_a_resume_passes_over_a_corrupt_newest_checkpoint_to_the_next_older(tmp_path, caplog):
    """A job restarted after its newest checkpoint was cut short (a full disk, a copy that
    died) resumes from the one before, with the reason logged, instead of dying on torch's
    read error (or loading an altered file)."""
    from producers_helpers import Tiny, train

    from spikeguard.producers import Guard, GuardConfig

    config = GuardConfig(
        checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=4, async_checkpoint=False
    )
    tiny = Tiny()
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        run_id="r",
        connect=False,
        config=config.model_copy(update={"resume": ResumeMode.NEVER}),
    )
    train(guard, tiny, 10)
    guard.close(finished=False)
    newest, older = guard.store.list(0)[:2]
    assert (newest.step, older.step) == (8, 4)
    raw = newest.path.read_bytes()
    newest.path.write_bytes(raw[: len(raw) - 100])
    again = Tiny(seed=1)
    resumed = Guard(again.model, again.optimizer, run_id="r", connect=False, config=config)
    assert resumed.resumed_from.step == 4 and resumed.step_count == 4
    assert any(
        "cannot be loaded" in r.getMessage() and "checksum mismatch" in r.getMessage()
        for r in caplog.records
    )
    resumed.close(finished=False)
