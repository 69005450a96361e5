"""Checkpoints written off the training thread, as torchtitan's async checkpointing does.

The step only takes a copy: every part's state is copied to CPU memory
("staging"), which costs a memcpy of the model and optimizer. ``torch.save``,
the fsync, the rename and the rotation then run on one background thread
(CheckpointStore.save, so atomic writes and "the newest healthy is never
rotated out" hold as before).

Bounded: at most one save is in flight and one staged copy exists (its
buffers are reused by the next copy once written).
When a save is due while the previous one is still being written, the
training thread waits for that write to finish before taking the new copy.
It never drops the new save (an emergency checkpoint is the one that matters
most) and never queues copies (memory would grow with a slow disk); the
waits are counted (``waits``, ``wait_seconds``) so a too-short interval shows.

Anything that reads the directory — a rollback, a resume, close — calls
``wait()`` first, so it sees the checkpoint it needs. A finished save is
handed back to the training thread by ``completed()``: the pipeline hears of a
checkpoint only once it is on disk.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from spikeguard.producers.checkpoints import CheckpointInfo, CheckpointStore


def stage(state: Any, reuse: Any = None) -> Any:
    """A CPU copy of ``state`` that later steps cannot change (tensors copied, containers rebuilt).

    ``reuse``: an earlier copy no longer in use; its tensors of the same shape and dtype
    are written into instead of allocating (as torchtitan keeps its staging buffers:
    fresh allocations of the whole state cost page faults every checkpoint).
    """
    if isinstance(state, torch.Tensor):
        if (
            isinstance(reuse, torch.Tensor)
            and reuse.shape == state.shape
            and reuse.dtype == state.dtype
            and reuse.device.type == "cpu"
            and reuse.is_contiguous()
            and state.layout == torch.strided
        ):
            return reuse.copy_(state.detach())
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        out: Any = OrderedDict() if isinstance(state, OrderedDict) else {}
        old = reuse if isinstance(reuse, dict) else {}
        for k, v in state.items():
            out[k] = stage(v, old.get(k))
        if hasattr(state, "_metadata"):  # a module's state_dict: load_state_dict reads its versions
            out._metadata = copy.deepcopy(state._metadata)
        return out
    if isinstance(state, (list, tuple)):
        reused: Sequence[Any] = (
            reuse
            if isinstance(reuse, (list, tuple)) and len(reuse) == len(state)
            else [None] * len(state)
        )
        items = [stage(v, o) for v, o in zip(state, reused, strict=True)]
        return items if isinstance(state, list) else tuple(items)
    return copy.copy(state)  # numbers and strings are shared; anything mutable (numpy state) copied


@dataclass
class SaveJob:
    """What the training thread knows about a save when it asks for it."""

    step: int
    epoch: int
    healthy: bool
    reason: str
    batch_index: int | None = None
    requests: list[Any] = field(default_factory=list)  # the CHECKPOINT actions it answers


@dataclass
class SaveResult:
    job: SaveJob
    info: CheckpointInfo | None = None
    removed: list[CheckpointInfo] = field(default_factory=list)
    error: BaseException | None = None


class AsyncSaver:
    def __init__(self, store: CheckpointStore, enabled: bool = True) -> None:
        self.store = store
        self.enabled = enabled
        self._pool = (
            ThreadPoolExecutor(1, thread_name_prefix="spikeguard-checkpoint") if enabled else None
        )
        self._inflight: tuple[SaveJob, Future] | None = None
        self._finished: list[SaveResult] = []
        self._buffers: Any = None  # the last staged copy, reused once written
        self.waits = 0  # saves that had to wait for the previous write
        self.wait_seconds = 0.0

    @property
    def in_flight(self) -> SaveJob | None:
        return self._inflight[0] if self._inflight is not None else None

    def submit(self, state: Callable[[], dict[str, Any]], job: SaveJob) -> None:
        """Save ``state()`` as ``job``: copied now, written in the background (or now, if disabled)."""
        if self._inflight is not None:
            if not self._inflight[1].done():
                self.waits += 1
                t0 = time.perf_counter()
                self._reap(block=True)
                self.wait_seconds += time.perf_counter() - t0
            else:
                self._reap(block=False)
        if not self.enabled:
            self._finished.append(self._write(state(), job))
            return
        # The previous copy has been written (waited for above): its buffers take this one.
        payload = self._buffers = stage(state(), self._buffers)
        assert self._pool is not None  # (enabled: made with its pool)
        self._inflight = (job, self._pool.submit(self._write, payload, job))

    def _write(self, payload: dict[str, Any], job: SaveJob) -> SaveResult:
        try:
            info = self.store.save(payload, step=job.step, epoch=job.epoch, healthy=job.healthy)
            return SaveResult(job, info, list(self.store.removed))
        except Exception as exc:  # noqa: BLE001 - handed to the training thread, which reports it
            return SaveResult(job, error=exc)

    def _reap(self, block: bool) -> None:
        if self._inflight is None or not (block or self._inflight[1].done()):
            return
        _, future = self._inflight
        self._inflight = None
        self._finished.append(future.result())

    def wait(self) -> None:
        """Until the save in flight (if any) is on disk."""
        self._reap(block=True)

    def completed(self) -> list[SaveResult]:
        """Saves finished since the last call, oldest first (never blocks)."""
        self._reap(block=False)
        done, self._finished = self._finished, []
        return done

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
