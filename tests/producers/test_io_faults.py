"""The Guard never kills the run it protects: its own write failures are reported, not raised.

A real model trains on the embedded bus while the checkpoint directory's disk
is full (every write's flush raises ENOSPC, as a full disk does) for a stretch
of steps: checkpoints, the action ledger and an incident record all fail.
"""

from __future__ import annotations

import errno
import logging

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
    return default_metrics().registry.get_sample_value("spikeguard_trainer_io_errors_total",
                                                       {"what": what}) or 0.0


def test_a_full_disk_never_stops_training_and_is_reported_once_per_kind(bus, tmp_path, monkeypatch, caplog):
    disk = FullDisk(monkeypatch)
    tiny = Tiny(seed=3)
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=10, async_checkpoint=False)
    before = {kind: _io_errors(kind.value) for kind in IOKind}
    lr_halved = action(ActionKind.SCALE_LR, 30, factor=0.5)
    rollback = action(ActionKind.ROLLBACK, 40, target_step=20).model_copy(update={"incident_id": "inc-full"})

    def on_step(guard, data, batch):
        disk.full = FULL_FROM <= guard.step_count < FREED_AT
        if guard.step_count == 28 and guard.epoch == 0:
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
    assert guard.counters["rollbacks"] == 1 and guard.epoch == 1
    assert disk.refused > 0
    # Every kind of write failed, each counted in the metric and the Guard's counters...
    for kind in IOKind:
        assert _io_errors(kind.value) - before[kind] >= 1, kind
        assert guard.io_faults.counts[kind.value] >= 1, kind
    assert guard.io_faults.counts[IOKind.CHECKPOINT.value] >= 3  # steps 30, 40 (x2 epochs), 50
    # ... and logged once per streak, not per failure; and once more when writes work again.
    failed_lines = [r for r in caplog.records if "write failed" in r.getMessage()]
    assert sorted(r.getMessage().split(": ")[2].split()[0] for r in failed_lines) == \
        sorted(kind.value for kind in IOKind), [r.getMessage() for r in failed_lines]
    assert any("disk full" in r.getMessage() for r in failed_lines)
    assert any("checkpoint writes work again" in r.getMessage() for r in caplog.records)
    # Writes work again: a checkpoint after the disk was freed, and the ledger on disk.
    assert any(c.step >= FREED_AT for c in guard.store.list())
    assert lr_halved.action_id in guard.ledger.read()["applied"]


def test_only_os_errors_are_absorbed(tmp_path):
    faults = IOFaults("r-x")
    assert faults.attempt(IOKind.LEDGER, lambda: (_ for _ in ()).throw(OSError(errno.EROFS, "ro"))) is False
    assert faults.failing(IOKind.LEDGER) and faults.counts["ledger"] == 1
    with pytest.raises(ZeroDivisionError):  # a bug is a bug, not a disk problem
        faults.attempt(IOKind.LEDGER, lambda: 1 / 0)
    assert faults.attempt(IOKind.LEDGER, lambda: None) is True and not faults.failing(IOKind.LEDGER)
