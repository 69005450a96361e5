"""The Guard never kills the run it protects: its own write failures are reported, not raised.

A real model trains on the embedded bus while the checkpoint directory's disk
is full (every write's flush raises ENOSPC, as a full disk does) for a stretch
of steps: checkpoints, the action ledger and an incident record all fail.
"""

from __future__ import annotations

import builtins
import errno
import io
import logging
import os
import tempfile

import pytest
from producers_helpers import Tiny, acks, action, make_guard, send, train

from spikeguard.forensics.record import IncidentBatches
from spikeguard.metrics import default_metrics
from spikeguard.producers import atomic
from spikeguard.producers.io_faults import IOFaults, IOKind
from spikeguard.schemas import AckStatus, ActionKind

FULL_FROM, FREED_AT, STEPS = 25, 60, 80


class FullDisk:
    """Every write's flush to disk fails with ENOSPC while ``full``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = False
        self.refused = 0
        real_flush, real_write = atomic.flush_to_disk, IncidentBatches.write

        def flush(handle):
            if self.full:
                self.refused += 1
                raise OSError(errno.ENOSPC, "No space left on device")
            real_flush(handle)

        def write_record(record, path):
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(record, path)

        monkeypatch.setattr(atomic, "flush_to_disk", flush)
        monkeypatch.setattr(IncidentBatches, "write", write_record)


def _io_errors(what: str) -> float:
    return (
        default_metrics().registry.get_sample_value(
            "spikeguard_trainer_io_errors_total", {"what": what}
        )
        or 0.0
    )


def test_a_full_disk_never_stops_training_and_is_reported_once_per_kind(
    bus, tmp_path, monkeypatch, caplog
):
    disk = FullDisk(monkeypatch)
    tiny = Tiny(seed=3)
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=10, async_checkpoint=False)
    before = {kind: _io_errors(kind.value) for kind in IOKind}
    lr_halved = action(ActionKind.SCALE_LR, 30, factor=0.5)
    rollback = action(ActionKind.ROLLBACK, 40, target_step=20).model_copy(
        update={"incident_id": "inc-full"}
    )

    def on_step(guard, data, batch):
        disk.full = FULL_FROM <= guard.step_count < FREED_AT
        if guard.step_count == 28 and guard.generation == 0:
            send(bus, lr_halved, rollback, guard=guard)

    caplog.set_level(logging.WARNING, logger="spikeguard")
    train(guard, tiny, STEPS, on_step)
    guard.close()

    # Training ran to the end; the actions still worked, the rollback from a checkpoint
    # written before the disk filled.
    assert guard.step_count == STEPS and not guard.should_stop
    by_id = {a.action_id: a for a in acks(bus)}
    assert by_id[lr_halved.action_id].status is AckStatus.APPLIED
    assert by_id[rollback.action_id].status is AckStatus.APPLIED
    assert guard.counters["rollbacks"] == 1 and guard.generation == 1
    assert disk.refused > 0
    # Every kind of write failed, each counted in the metric and the Guard's counters...
    for kind in IOKind:
        assert _io_errors(kind.value) - before[kind] >= 1, kind
        assert guard.io_faults.counts[kind.value] >= 1, kind
    assert guard.io_faults.counts[IOKind.CHECKPOINT.value] >= 3  # steps 30, 40 (x2 epochs), 50
    # ... and logged once per streak, not per failure; and once more when writes work again.
    failed_lines = [r for r in caplog.records if "write failed" in r.getMessage()]
    assert sorted(r.getMessage().split(": ")[2].split()[0] for r in failed_lines) == sorted(
        kind.value for kind in IOKind
    ), [r.getMessage() for r in failed_lines]
    assert any("disk full" in r.getMessage() for r in failed_lines)
    assert any("checkpoint writes work again" in r.getMessage() for r in caplog.records)
    # Writes work again: a checkpoint after the disk was freed, and the ledger on disk.
    assert any(c.step >= FREED_AT for c in guard.store.list())
    assert lr_halved.action_id in guard.ledger.read()["applied"]


def test_only_os_errors_are_absorbed(tmp_path):
    faults = IOFaults("r-x")
    assert (
        faults.attempt(IOKind.LEDGER, lambda: (_ for _ in ()).throw(OSError(errno.EROFS, "ro")))
        is False
    )
    assert faults.failing(IOKind.LEDGER) and faults.counts["ledger"] == 1
    with pytest.raises(ZeroDivisionError):  # a bug is a bug, not a disk problem
        faults.attempt(IOKind.LEDGER, lambda: 1 / 0)
    assert faults.attempt(IOKind.LEDGER, lambda: None) is True and not faults.failing(IOKind.LEDGER)


class ReadOnlyDirectory:
    """While ``on``, everything that would create, replace or link a file under ``root`` fails
    with EROFS, as on a directory remounted read-only (reading still works)."""

    def __init__(self, root, monkeypatch: pytest.MonkeyPatch) -> None:
        self.on, self.root = False, os.fspath(root)
        real_mkstemp, real_replace, real_link, real_mkdir, real_open = (
            tempfile.mkstemp,
            os.replace,
            os.link,
            os.mkdir,
            io.open,
        )

        def refuse(path) -> None:
            if self.on and os.fspath(path).startswith(self.root):
                raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))

        def mkstemp(*args, dir=None, **kwargs):
            refuse(dir if dir is not None else "")
            return real_mkstemp(*args, dir=dir, **kwargs)

        def replace(src, dst, **kwargs):
            refuse(dst)
            return real_replace(src, dst, **kwargs)

        def link(src, dst, **kwargs):
            refuse(dst)
            return real_link(src, dst, **kwargs)

        def mkdir(path, *args, **kwargs):
            refuse(path)
            return real_mkdir(path, *args, **kwargs)

        def open_(file, mode="r", *args, **kwargs):
            if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
                refuse(file)
            return real_open(file, mode, *args, **kwargs)

        for owner, name, fake in (
            (tempfile, "mkstemp", mkstemp),
            (os, "replace", replace),
            (os, "link", link),
            (os, "mkdir", mkdir),
            (io, "open", open_),
            (builtins, "open", open_),
        ):
            monkeypatch.setattr(owner, name, fake)


def test_a_read_only_checkpoint_directory_never_stops_training(bus, tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    read_only = ReadOnlyDirectory(directory, monkeypatch)
    tiny = Tiny(seed=4)
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=10, async_checkpoint=False)
    # An incident: its first action demotes (renames) the checkpoints taken after its onset and
    # writes its forensic record, both of which fail on a read-only directory; then a rollback.
    lr_lowered = action(ActionKind.SCALE_LR, 35, factor=0.5).model_copy(
        update={"incident_id": "inc-ro"}
    )
    rollback = action(ActionKind.ROLLBACK, 36, target_step=20).model_copy(
        update={"incident_id": "inc-ro"}
    )

    def on_step(guard, data, batch):
        read_only.on = guard.step_count >= 22 or guard.generation > 0
        if guard.step_count == 34 and guard.generation == 0:
            send(bus, lr_lowered, rollback, guard=guard)

    train(guard, tiny, 60, on_step)
    read_only.on = False
    guard.close()

    assert guard.step_count == 60 and guard.counters["rollbacks"] == 1
    by_id = {a.action_id: a for a in acks(bus)}
    assert (
        by_id[lr_lowered.action_id].status is by_id[rollback.action_id].status is AckStatus.APPLIED
    )
    for kind in IOKind:
        assert guard.io_faults.counts[kind.value] >= 1, kind


def test_a_full_disk_at_start_does_not_stop_the_embedded_runtime_recording_to_data_dir(
    tmp_path, monkeypatch, caplog
):
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import Settings

    disk = FullDisk(monkeypatch)
    disk.full = True
    caplog.set_level(logging.WARNING, logger="spikeguard")
    runtime = open_runtime(Settings(data_dir=str(tmp_path / "recording")))
    try:
        assert runtime.bus is not None and disk.refused >= 1
    finally:
        runtime.close()
    assert any(
        "could not record the judging settings" in r.getMessage() and "disk full" in r.getMessage()
        for r in caplog.records
    )


def test_a_torn_ledger_sidecar_does_not_stop_a_resume(bus, tmp_path, caplog):
    tiny = Tiny(seed=6)
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=5)
    train(guard, tiny, 12)
    guard.close(finished=False)
    sidecar = tmp_path / "ckpt" / "spikeguard-ledger.json"
    sidecar.write_bytes(sidecar.read_bytes()[:20])  # torn mid-write by a crash or a failing device

    caplog.set_level(logging.WARNING, logger="spikeguard")
    again = make_guard(Tiny(seed=6), bus, tmp_path, checkpoint_every=5, resume=True)
    assert again.step_count == 10  # resumed from its newest checkpoint all the same
    assert any(
        "ledger" in r.getMessage() and "unreadable" in r.getMessage() for r in caplog.records
    )
    again.close(finished=False)
