"""Checkpoints on disk: atomic, rotated, loadable with ``weights_only=True``.

A file's name says everything rotation needs — epoch, step, healthy or not,
id — so there is no index file to get out of step with the files after a
crash. Rotation keeps the newest ``keep`` checkpoints and, always, the
newest healthy one: a burst of checkpoints taken during an incident can never
push the last good state out. "Newest" is (epoch, step): every checkpoint of
epoch e+1 (after a rollback) is newer than every one of epoch e.

Lateness never costs recoverability: while the pipeline has not judged every
step yet, rotation also keeps the rollback target a decision still to come may
need (:class:`Awaiting`, set by the trainer from the pipeline's pulses,
checkpointing.py): the newest healthy checkpoint far enough before the oldest
step not yet judged, whatever ``keep`` says. A decision that comes late (an
outage, a flood, a restarted worker) still finds a checkpoint before its onset.

With several ranks, rank 0 writes the full checkpoint and every other rank a
small companion file with its own RNG state (``...-<id>.rank<r>.pt``).

A sharded model's state (sharded.py: what a part holds under ``DCP_KEY``) is
written with ``torch.distributed.checkpoint`` into ``dcp-<id>/`` beside the
files, every rank its own shards, before the files: a rank-0 file on disk
means its shards are complete. The directory has no health flag in its name,
so demoting a checkpoint renames the file only; rank 0 deletes the
directory with the file, and on start the directories no file refers to
(a crash between the two writes).

Every file has its SHA-256 beside it (``ckpt-<id>[.rank<r>].sha256``, computed
while the file is written, stored after it is in place; no health flag in
its name either). Loading checks it first: a truncated or altered file is
refused with :class:`CheckpointUnreadable`, as is one that torch cannot read,
or a rank's missing companion, so that the caller can fall back to an older
checkpoint instead of loading garbage (checkpointing.py). A file without its
checksum (a crash between the two writes, or written before checksums) is
loaded unverified.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, List, NamedTuple, Sequence, cast

import torch

from spikeguard.errors import SpikeguardError
from spikeguard.producers.atomic import atomic_write, atomic_write_bytes, remove_stale_temps
from spikeguard.producers.sharded import DCP_KEY

log = logging.getLogger(__name__)

FORMAT = 2  # 2: one entry per Guard part (format 1 nested lr/clip/health/ledger under "guard")
_NAME = re.compile(r"^ckpt-e(\d+)-s(\d+)-([hu])-(c-[0-9a-f]+)(?:\.rank(\d+))?\.pt$")
_SUM = re.compile(r"^ckpt-(c-[0-9a-f]+)(?:\.rank(\d+))?\.sha256$")


class CheckpointUnreadable(SpikeguardError):
    """This rank cannot load a checkpoint: a file is missing, truncated, altered or unreadable."""


class _Hashing:
    """A writable file that hashes what goes through it (torch.save writes through ``write``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.sha256 = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.sha256.update(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_id(run_id: str, step: int, epoch: int = 0) -> str:
    """The same (run, epoch, step) always names the same checkpoint."""
    text = "\x1f".join(("checkpoint", run_id, str(epoch), str(step)))
    return "c-" + hashlib.sha256(text.encode()).hexdigest()[:20]


def _rank_of(name: str) -> int:
    """The rank that writes the file ``name`` (rank 0 writes everything but companions)."""
    m = _NAME.match(name)
    return int(m.group(5)) if m and m.group(5) is not None else 0


class Awaiting(NamedTuple):
    """Decisions not made yet may need a rollback target at or before step ``max_step`` of
    ``epoch``: the oldest step not yet judged, less the policy's distance before an onset
    (``max_step`` below 0: nothing judged yet, the oldest healthy checkpoint is kept)."""

    epoch: int
    max_step: int


@dataclass(frozen=True)
class CheckpointInfo:
    checkpoint_id: str
    step: int
    epoch: int
    healthy: bool
    path: Path
    rank: int = 0

    @property
    def order(self) -> tuple[int, int]:
        return (self.epoch, self.step)


class CheckpointStore:
    """The checkpoints of one run (as one rank sees them) in one directory."""

    def __init__(
        self, directory: str | os.PathLike, run_id: str, keep: int = 3, rank: int = 0
    ) -> None:
        #: What the last save rotated out (the guard tells the actuator).
        self.removed: list[CheckpointInfo] = []
        self.directory = Path(directory)
        self.run_id = run_id
        self.keep = keep
        #: What the decisions still to come may need (None: nobody judges this run); read by
        #: rotation, on the saver's thread.
        self.awaiting: Awaiting | None = None
        self.rank = rank
        self.directory.mkdir(parents=True, exist_ok=True)
        # Only this rank's leftovers: the directory is shared, and another rank may be
        # writing its own temp file right now.
        remove_stale_temps(self.directory, owned=lambda target: _rank_of(target) == self.rank)
        if rank == 0:
            self._remove_orphan_shards()
        self._remove_orphan_sums()

    # -- listing --------------------------------------------------------------
    def list(self, rank: int | None = None) -> list[CheckpointInfo]:
        """This rank's checkpoints (or ``rank``'s), newest first."""
        rank = self.rank if rank is None else rank
        found = []
        for path in self.directory.iterdir():
            m = _NAME.match(path.name)
            if not m:
                continue
            file_rank = int(m.group(5)) if m.group(5) is not None else 0
            if file_rank != rank:
                continue
            found.append(
                CheckpointInfo(
                    m.group(4), int(m.group(2)), int(m.group(1)), m.group(3) == "h", path, file_rank
                )
            )
        return sorted(found, key=lambda c: c.order, reverse=True)

    def newest(self) -> CheckpointInfo | None:
        found = self.list(0)
        return found[0] if found else None

    def find(self, checkpoint_id: str) -> CheckpointInfo | None:
        return next((c for c in self.list(0) if c.checkpoint_id == checkpoint_id), None)

    def newest_healthy(self, max_step: int | None = None) -> CheckpointInfo | None:
        for c in self.list(0):
            if c.healthy and (max_step is None or c.step <= max_step):
                return c
        return None

    # -- writing --------------------------------------------------------------
    def save(
        self, payload: dict[str, Any], *, step: int, epoch: int, healthy: bool
    ) -> CheckpointInfo:
        """Write ``payload`` atomically (this rank's file), then rotate."""
        cid = checkpoint_id(self.run_id, step, epoch)
        suffix = f".rank{self.rank}.pt" if self.rank else ".pt"
        name = f"ckpt-e{epoch:05d}-s{step:010d}-{'h' if healthy else 'u'}-{cid}{suffix}"
        path = self.directory / name
        payload = self._save_shards(payload, cid)
        body = dict(
            payload,
            format=FORMAT,
            checkpoint_id=cid,
            step=step,
            epoch=epoch,
            healthy=healthy,
            run_id=self.run_id,
        )
        checksum = self.sum_path(cid)
        checksum.unlink(missing_ok=True)  # (a stale one must not vouch for the new file)
        hashing: list[_Hashing] = []

        def write(handle: Any) -> None:
            hashing.append(_Hashing(handle))
            torch.save(body, cast(IO[bytes], hashing[0]))  # (it writes through ``write``)

        atomic_write(path, write)
        atomic_write_bytes(checksum, hashing[0].sha256.hexdigest().encode())
        info = CheckpointInfo(cid, step, epoch, healthy, path, self.rank)
        for other in self.list():
            # The same step saved again with the other health flag: one file per id.
            if other.checkpoint_id == cid and other.path != path:
                other.path.unlink(missing_ok=True)
        self.removed = self.rotate()
        return info

    def demote(self, after_step: int, epoch: int) -> List[CheckpointInfo]:
        """Mark this epoch's healthy checkpoints after ``after_step`` unhealthy (renamed, atomically);
        returns them as they are now. An incident found late began before they were taken."""
        demoted = []
        for c in self.list():
            if c.healthy and c.epoch == epoch and c.step > after_step:
                path = c.path.with_name(
                    c.path.name.replace(f"-s{c.step:010d}-h-", f"-s{c.step:010d}-u-", 1)
                )
                os.replace(c.path, path)
                demoted.append(
                    CheckpointInfo(c.checkpoint_id, c.step, c.epoch, False, path, c.rank)
                )
        return demoted

    def rotate(self) -> List[CheckpointInfo]:
        """Delete all but the newest ``keep``, the newest healthy and the one a decision still to
        come may need (:meth:`awaited`); returns what went."""
        found = self.list()
        keep = set(c.path for c in found[: self.keep])
        for held in (next((c for c in found if c.healthy), None), self.awaited(found)):
            if held is not None:
                keep.add(held.path)
        removed = [c for c in found if c.path not in keep]
        for c in removed:
            c.path.unlink(missing_ok=True)
            self.sum_path(c.checkpoint_id).unlink(missing_ok=True)
            if self.rank == 0:
                shutil.rmtree(self.shard_dir(c.checkpoint_id), ignore_errors=True)
        return removed

    def awaited(self, found: Sequence[CheckpointInfo]) -> CheckpointInfo | None:
        """Of ``found`` (newest first), the rollback target a decision not made yet may need: the
        newest healthy one at or before ``awaiting``; when none is that far back, the oldest
        healthy one (the nearest there is to what such a decision asks for)."""
        awaiting = self.awaiting
        if awaiting is None:
            return None
        healthy = [c for c in found if c.healthy and c.epoch <= awaiting.epoch]
        far_enough = [c for c in healthy if c.step <= awaiting.max_step]
        if far_enough:
            return far_enough[0]
        return healthy[-1] if healthy else None

    def sum_path(self, cid: str, rank: int | None = None) -> Path:
        """Where the SHA-256 of ``rank``'s file of checkpoint ``cid`` is (this rank's by default)."""
        rank = self.rank if rank is None else rank
        return self.directory / (f"ckpt-{cid}.rank{rank}.sha256" if rank else f"ckpt-{cid}.sha256")

    def _remove_orphan_sums(self) -> None:
        known = {c.checkpoint_id for c in self.list()}
        for path in self.directory.glob("ckpt-c-*.sha256"):
            m = _SUM.match(path.name)
            if m and int(m.group(2) or 0) == self.rank and m.group(1) not in known:
                path.unlink(missing_ok=True)

    # -- sharded state (torch.distributed.checkpoint) ---------------------------
    def shard_dir(self, cid: str) -> Path:
        return self.directory / f"dcp-{cid}"

    def _save_shards(self, payload: dict[str, Any], cid: str) -> dict[str, Any]:
        """Write the parts' ``DCP_KEY`` state with dcp.save (collective); their path stays in the file."""
        sharded = {
            name: part[DCP_KEY]
            for name, part in payload.items()
            if isinstance(part, dict) and DCP_KEY in part
        }
        if not sharded:
            return payload
        if len(sharded) > 1:
            raise ValueError(f"one sharded part per checkpoint, got {sorted(sharded)}")
        import torch.distributed.checkpoint as dcp

        target = self.shard_dir(cid)
        dcp.save(
            next(iter(sharded.values())), checkpoint_id=str(target)
        )  # the part loads it as it is
        return {
            name: dict(part, **{DCP_KEY: target.name}) if name in sharded else part
            for name, part in payload.items()
        }

    def _with_shard_paths(self, body: dict[str, Any]) -> dict[str, Any]:
        for part in body.values():
            if isinstance(part, dict) and isinstance(part.get(DCP_KEY), str):
                part[DCP_KEY] = str(self.directory / part[DCP_KEY])
        return body

    def _remove_orphan_shards(self) -> None:
        known = {c.checkpoint_id for c in self.list(0)}
        for path in self.directory.glob("dcp-c-*"):
            if path.is_dir() and path.name[len("dcp-") :] not in known:
                shutil.rmtree(path, ignore_errors=True)

    # -- reading --------------------------------------------------------------
    def load(self, info: CheckpointInfo) -> dict[str, Any]:
        """The checkpoint's payload, plus this rank's companion file under ``"rank_state"``.

        Raises :class:`CheckpointUnreadable` when a file this rank needs is missing,
        fails its checksum, or cannot be read.
        """
        body = self._read(info.path, self.sum_path(info.checkpoint_id, 0))
        if body.get("format") == 1:  # the guard's parts were nested then
            nested = body.pop("guard", {})
            body.update(
                lr=nested.get("lr"),
                clip=nested.get("clip"),
                health=nested.get("health"),
                ledger=nested.get("ledger"),
                format=FORMAT,
            )
        if body.get("format") != FORMAT:
            raise CheckpointUnreadable(
                f"{info.path.name}: unknown checkpoint format {body.get('format')!r}"
            )
        if self.rank:
            companion = next(
                (c for c in self.list() if c.checkpoint_id == info.checkpoint_id), None
            )
            if companion is None:
                raise CheckpointUnreadable(
                    f"checkpoint {info.checkpoint_id} (step {info.step}) has no "
                    f"state of rank {self.rank} (its companion file is missing)"
                )
            body["rank_state"] = self._with_shard_paths(
                self._read(companion.path, self.sum_path(info.checkpoint_id))
            )
        return self._with_shard_paths(body)

    def _read(self, path: Path, checksum: Path) -> dict[str, Any]:
        try:
            expected = checksum.read_text().strip() if checksum.exists() else None
            if expected is not None and file_sha256(path) != expected:
                raise CheckpointUnreadable(
                    f"{path.name}: checksum mismatch (the file is truncated or altered)"
                )
            return torch.load(path, map_location="cpu", weights_only=True)
        except CheckpointUnreadable:
            raise
        except Exception as exc:
            raise CheckpointUnreadable(
                f"{path.name}: cannot be read: {type(exc).__name__}: {exc}"
            ) from exc
