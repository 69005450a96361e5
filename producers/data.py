"""A DataLoader wrapper that knows where it is: global batch index, resume, skip.

Global batch index ``g`` lives in data epoch ``g // batches_per_epoch``;
the order inside an epoch is a permutation seeded by ``(seed, epoch)`` alone,
so it never depends on how often the run rolled back or restarted: resuming
at ``g`` yields exactly the batch an uninterrupted run sees at ``g``.

For a map-style dataset under a standard sampler (random, sequential or
distributed) the wrapper rebuilds the DataLoader from a given index on (no
batch is read to get there), with its own seeded generator so that building
an iterator never consumes the global RNG. Anything else is *replayed*: the
epoch is iterated from its start and the batches before the index thrown
away — exact only if the iterable's own order is deterministic.

Skip ranges (inclusive global indices) are jumped over; they are kept across
rollbacks (bad data stays bad) and restored from the guard's ledger.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset,
                              RandomSampler, SequentialSampler)


def epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"spikeguard-data\x1f{seed}\x1f{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def merge_ranges(ranges: list[list[int]]) -> list[list[int]]:
    merged: list[list[int]] = []
    for start, end in sorted((int(a), int(b)) for a, b in ranges if b >= a):
        if merged and start <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


class GuardedLoader:
    """Iterate like the wrapped loader; ``position`` is the next global batch index."""

    def __init__(self, loader: Any, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 epochs: int | None = None, stop_when: Callable[[], bool] | None = None,
                 before_batch: Callable[[], None] | None = None) -> None:
        self.loader = loader
        self.seed = seed
        self.epochs = epochs
        self.stop_when = stop_when
        self.before_batch = before_batch
        self.position = 0
        self.last_index: int | None = None
        self.ran_out = False  # the last iteration ended at the end of the data (not by a stop)
        # The batches read since the last take_span(): one optimizer step's (micro-)batches.
        self._span = (-1, -1, 0)
        self.skip_ranges: list[list[int]] = []
        self._iter: Iterator[tuple[int, Any]] | None = None
        self._epoch_end = 0
        self._limit: int | None = None
        self._rebuild = self._standard(loader)
        if self._rebuild:
            sampler = loader.sampler
            self.shuffle = isinstance(sampler, RandomSampler) or (
                isinstance(sampler, DistributedSampler) and sampler.shuffle)
            if isinstance(sampler, DistributedSampler):
                rank, world_size = sampler.rank, sampler.num_replicas
            self.rank, self.world_size = rank, world_size
            self.batch_size = loader.batch_size
            n, per = len(loader.dataset), self.batch_size * self.world_size
            if self.world_size > 1 or loader.drop_last:
                self.batches_per_epoch = max(1, n // per)
            else:
                self.batches_per_epoch = max(1, math.ceil(n / per))
        else:
            self.shuffle = False
            self.rank, self.world_size = rank, world_size
            self.batches_per_epoch = len(loader) if hasattr(loader, "__len__") else None

    @staticmethod
    def _standard(loader: Any) -> bool:
        return (isinstance(loader, DataLoader)
                and not isinstance(loader.dataset, IterableDataset)
                and type(loader.batch_sampler) is BatchSampler
                and type(loader.sampler) in (RandomSampler, SequentialSampler, DistributedSampler))

    # -- position control -----------------------------------------------------
    def seek(self, position: int) -> None:
        """The next batch yielded is the first non-skipped one at or after ``position``."""
        self.position = int(position)
        self._iter = None
        self._span = (-1, -1, 0)  # what was read before a seek belongs to no step that will run

    def skip(self, start: int, end: int) -> None:
        """Never yield global indices ``start..end`` (inclusive)."""
        self.skip_ranges = merge_ranges(self.skip_ranges + [[start, end]])
        self._iter = None

    def take_span(self) -> tuple[int, int, int]:
        """(first, last, count) of the batches read since the last call, and start anew."""
        span, self._span = self._span, (-1, -1, 0)
        return span

    def skipped(self, index: int) -> bool:
        return any(a <= index <= b for a, b in self.skip_ranges)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "skip_ranges": [list(r) for r in self.skip_ranges],
                "seed": self.seed, "batches_per_epoch": self.batches_per_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state.get("seed", self.seed))
        self.skip_ranges = merge_ranges(self.skip_ranges + [list(r) for r in state.get("skip_ranges", ())])
        self.seek(int(state["position"]))

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("the wrapped iterable has no length")
        return self.batches_per_epoch

    # -- iteration ------------------------------------------------------------
    def __iter__(self) -> "GuardedLoader":
        bpe = self.batches_per_epoch
        if self.epochs is not None and bpe:
            self._limit = self.epochs * bpe
        elif bpe:  # one pass: to the end of the data epoch we are in
            self._limit = (self.position // bpe + 1) * bpe
        else:
            self._limit = None
        return self

    def __next__(self) -> Any:
        while True:
            if self.stop_when is not None and self.stop_when():
                raise StopIteration
            if self._limit is not None and self.position >= self._limit:
                self.ran_out = True  # the data's end, not a stop: the run is finished
                raise StopIteration
            if self.before_batch is not None:
                self.before_batch()
            if self._iter is None:
                self._iter = self._open(self.position)
            try:
                index, batch = next(self._iter)
            except StopIteration:
                self._iter = None
                if self.batches_per_epoch is None:
                    self.ran_out = True
                    raise
                self.position = max(self.position, self._epoch_end)
                continue
            self.last_index = index
            self.ran_out = False
            first, _, count = self._span
            self._span = (index if count == 0 else first, index, count + 1)
            self.position = index + 1
            return batch

    def _open(self, position: int) -> Iterator[tuple[int, Any]]:
        bpe = self.batches_per_epoch
        epoch = position // bpe if bpe else 0
        first = epoch * bpe if bpe else 0
        self._epoch_end = first + bpe if bpe else 0
        if self._rebuild:
            return self._open_rebuilt(epoch, first, position)
        return self._open_replay(first, position)

    def _open_rebuilt(self, epoch: int, first: int, position: int) -> Iterator[tuple[int, Any]]:
        loader, n = self.loader, len(self.loader.dataset)
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch_seed(self.seed, epoch)))
        else:
            order = torch.arange(n)
        positions = [g for g in range(position, self._epoch_end) if not self.skipped(g)]
        bs, w = self.batch_size, self.world_size
        batches = []
        for g in positions:
            start = ((g - first) * w + self.rank) * bs
            batches.append(order[start:start + bs].tolist())
        kwargs: dict[str, Any] = dict(
            batch_sampler=batches, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
            generator=torch.Generator().manual_seed(epoch_seed(self.seed, -1 - position)),
        )
        if loader.num_workers > 0:
            kwargs.update(multiprocessing_context=loader.multiprocessing_context,
                          prefetch_factor=loader.prefetch_factor)
        return zip(positions, DataLoader(loader.dataset, **kwargs))

    def _open_replay(self, first: int, position: int) -> Iterator[tuple[int, Any]]:
        def replay() -> Iterator[tuple[int, Any]]:
            for offset, batch in enumerate(self.loader):
                index = first + offset
                if index >= position and not self.skipped(index):
                    yield index, batch
        return replay()
