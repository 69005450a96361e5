"""A run's life on disk: resumed, finished, or started again — and saying which.

A run is *finished* when ``guard.close()`` comes after its planned steps (or
after the loader ran out of data), or when the user saved a ``"final"``
checkpoint; the sidecar then records it. Starting a finished run_id again
does not resume it (that trained 0 steps, silently): its files are moved
aside to ``<checkpoint dir>/finished-<UTC time>/`` and the run starts from
step 0. ``resume="never"`` moves any earlier files aside the same way, and
``resume="must"`` raises when there is nothing unfinished to resume.
Resuming an unfinished run is announced in one WARNING line on the
``spikeguard.producers.guard`` logger, which Python shows by default.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from spikeguard.producers.checkpoints import checkpoint_id
from spikeguard.producers.ledger import SIDECAR


def read_sidecar(directory: Path) -> dict[str, Any] | None:
    """The sidecar's content without merging anything (None when absent or unreadable)."""
    path = Path(directory) / SIDECAR
    try:
        body = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def owner(directory_run: Any, run_id: str, checkpoints: list[Any]) -> str | None:
    """The run whose files these are, when not ``run_id``'s (None: this run's, or none).

    ``directory_run``: the sidecar's run_id (None: no sidecar, or an older one without it). A
    checkpoint's id is derived from its run's id, epoch and step, so a file another run wrote
    says so without being opened."""
    if directory_run:
        return None if directory_run == run_id else str(directory_run)
    for c in checkpoints:
        if c.checkpoint_id != checkpoint_id(run_id, c.step, c.epoch):
            return "another run"
    return None


def not_ours_message(run_id: str, other: str, directory: Path) -> str:
    return (
        f"checkpoint_dir {directory} holds the unfinished checkpoints of run {other}, not of run "
        f"{run_id}: in one directory, the runs would resume each other's weights and delete each "
        f"other's checkpoints. Give each run its own checkpoint_dir (the default, None, is "
        f"./spikeguard-checkpoints/<run_id>), or resume {other} with run_id={other!r}"
    )


def finished_fact(step: int, epoch: int, reason: str) -> dict[str, Any]:
    return {"step": step, "epoch": epoch, "reason": reason, "time": time.time()}


def archive_finished(directory: Path) -> Path:
    """Move a finished run's checkpoints and sidecar into a new ``finished-<time>`` folder."""
    directory = Path(directory)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, n = directory / f"finished-{stamp}", 1
    while target.exists():  # two finished runs within one second
        n += 1
        target = directory / f"finished-{stamp}-{n}"
    target.mkdir()
    for path in directory.iterdir():
        ours = path.is_file() and (path.name == SIDECAR or path.name.startswith("ckpt-"))
        if ours or (path.is_dir() and path.name.startswith("dcp-")):  # a sharded model's shards
            path.rename(target / path.name)
    return target


def finished_message(
    run_id: str, side: dict[str, Any], archived: Path, starting: str | None = None
) -> str:
    """``run_id``: the finished run's; ``starting``: the run that starts instead, if another."""
    fact = side.get("finished") or {}
    how = (
        f"run {starting} trains from step 0; give each run its own checkpoint_dir"
        if starting and starting != run_id
        else "training from step 0 (give each run its own run_id to keep them apart)"
    )
    return (
        f"spikeguard: run {run_id} already finished (step {fact.get('step')}, {fact.get('reason')}); "
        f"not resuming it: its checkpoints were moved to {archived}; {how}"
    )


def fresh_message(run_id: str, archived: Path) -> str:
    return (
        f"spikeguard: resume='never': run {run_id} starts from step 0; its earlier checkpoints were "
        f"moved to {archived}"
    )


def resume_message(run_id: str, info: Any, directory: Path) -> str:
    return (
        f"spikeguard: resuming run {run_id} from step {info.step} (epoch {info.epoch}) of checkpoint "
        f"{info.checkpoint_id} in {directory}; resume='never' or a new run_id starts over"
    )
