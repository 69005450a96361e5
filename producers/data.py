"""A wrapper around the user's own loader that knows where it is: global batch index, resume, skip.

The loader is never rebuilt: every batch comes out of the user's own
``__iter__``, so its class, sampler, collate and device placement (accelerate's
prepared loaders, DDP's DistributedSampler) are what the training loop sees.

Global batch index ``g`` lives in data epoch ``g // len(loader)``. Entering a
data epoch tells the loader which one it is (``set_epoch`` on the loader if it
has one, as accelerate's does, else on its sampler, as DDP's needs). The
randomness a DataLoader draws as an epoch starts (a RandomSampler's seed, the
workers' base seed) comes, by default (``seed=None``), from the same global
RNG draws the unguarded loader would make, in the same order, so that a run
the Guard never acts on is the user's run to the bit; what was drawn is
recorded per data epoch (``state_dict``: it travels in checkpoints) and an
epoch entered again (a rollback, a resume) reads that record, never draws
anew. With ``seed=N`` (``GuardConfig.data_seed``) those draws are seeded by
``(N, epoch)`` alone: an order known in advance, independent of the global
RNG. Either way the order never depends on how often the run rolled back or
restarted: resuming at ``g`` yields exactly the batch an uninterrupted run
sees at ``g``.

Resume, rollback and skip ranges all *read and drop*: the epoch is iterated
from its start and the batches before the index (or inside a skip range)
thrown away. Why not jump with the sampler's state: torch's samplers offer
none (only an epoch), and skipping below the user's ``__iter__`` would
bypass exactly the code (placement, sharding, per-batch transforms) that
decides what a batch is. The cost is reading the dropped batches — no
forward or backward — and a forward jump within the epoch reads on from the
live iterator instead of starting over. Dropped batches are read with the
random streams saved and put back, so they draw nothing the training loop
would have drawn. Exact for any loader whose order within an epoch is
deterministic.

Skip ranges (inclusive global indices) are jumped over; they are kept across
rollbacks (bad data stays bad) and restored from the guard's ledger.

How far it reads: ``epochs`` passes when given; else, with ``until_stopped``
(the Guard sets it when ``guard.data(loader, max_steps=N)`` names the run's
length), data epoch after data epoch until the Guard stops it at
``max_steps``, so a skip window that used up data never shortens the run (the
data is read again from its start, in the next epoch's order, and a WARNING
says so); else one pass, to the end of the data epoch it is in.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from spikeguard.producers import rng
from spikeguard.producers.epoch_draws import EpochDraws
from spikeguard.producers.epoch_draws import samplers as _samplers

log = logging.getLogger("spikeguard.producers.guard")


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
    """Iterate like the wrapped loader; ``position`` is the next global batch index.

    ``dropped`` counts the batches read from the loader and thrown away (replay
    to a resume or rollback point, skip ranges).
    """

    def __init__(
        self,
        loader: Any,
        *,
        seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        epochs: int | None = None,
        stop_when: Callable[[], bool] | None = None,
        before_batch: Callable[[], None] | None = None,
        on_batch: Callable[[Any, bool], None] | None = None,
        on_open: Callable[[], None] | None = None,
    ) -> None:
        self.loader = loader
        # None: each epoch's draws are the unguarded loader's own, recorded (EpochDraws). An int:
        # they are seeded by (seed, epoch), even where the user passed a generator, so a second
        # wrapper of the same loader (a reference run) reads the same order.
        self.seed = seed
        self.draws = EpochDraws(loader)
        self.epochs = epochs
        self.until_stopped = False  # read data epoch after data epoch until stop_when (max_steps)
        self.stop_when = stop_when
        self.before_batch = before_batch
        # Forensics (producers/incidents.py): every batch read, used or dropped, and each new
        # pass over the loader, so sample ids stay matched to batches.
        self.on_batch = on_batch
        self.on_open = on_open
        self.position = 0
        self.last_index: int | None = None
        self.ran_out = False  # the last iteration ended at the end of the data (not by a stop)
        self.dropped = 0
        # The batches read since the last take_span(): one optimizer step's (micro-)batches.
        self._span = (-1, -1, 0)
        self.skip_ranges: list[list[int]] = []
        self._iter: Iterator[Any] | None = None
        self._next_index = 0  # the global index of what the live iterator yields next
        self._epoch_end = 0
        self._limit: int | None = None
        self._newest_epoch = 0  # the furthest data epoch opened so far
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            rank, world_size = sampler.rank, sampler.num_replicas
        self.rank, self.world_size = rank, world_size
        try:
            self.batches_per_epoch: int | None = len(loader)
        except TypeError:  # an iterable without a length: one pass, replayed from its start
            self.batches_per_epoch = None

    # -- position control -----------------------------------------------------
    def seek(self, position: int) -> None:
        """The next batch yielded is the first non-skipped one at or after ``position``."""
        self.position = int(position)
        self._span = (-1, -1, 0)  # what was read before a seek belongs to no step that will run

    def skip(self, start: int, end: int) -> None:
        """Never yield global indices ``start..end`` (inclusive)."""
        self.skip_ranges = merge_ranges(self.skip_ranges + [[start, end]])

    def take_span(self) -> tuple[int, int, int]:
        """(first, last, count) of the batches read since the last call, and start anew."""
        span, self._span = self._span, (-1, -1, 0)
        return span

    def batches_read(self) -> int:
        """The batches read since the last take_span(): this step's, so far."""
        return self._span[2]

    def skipped(self, index: int) -> bool:
        return any(a <= index <= b for a, b in self.skip_ranges)

    def state_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "skip_ranges": [list(r) for r in self.skip_ranges],
            "seed": self.seed,
            "batches_per_epoch": self.batches_per_epoch,
            "epoch_draws": self.draws.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        seed = state.get("seed", self.seed)
        self.seed = None if seed is None else int(seed)
        self.draws.load_state_dict(state.get("epoch_draws", {}))
        self.skip_ranges = merge_ranges(
            self.skip_ranges + [list(r) for r in state.get("skip_ranges", ())]
        )
        self.seek(int(state["position"]))

    def data_end(self) -> int | None:
        """One past the last global index this iteration may read (None: no end, or not iterating)."""
        return self._limit

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("the wrapped iterable has no length")
        return self.batches_per_epoch

    # -- iteration ------------------------------------------------------------
    def __iter__(self) -> "GuardedLoader":
        bpe = self.batches_per_epoch
        if self.epochs is not None and bpe:
            self._limit = self.epochs * bpe
        elif bpe and not self.until_stopped:  # one pass: to the end of the data epoch we are in
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
                if self.batches_per_epoch and self._next_index >= self._epoch_end:
                    self._finish_epoch()
                raise StopIteration
            if self.before_batch is not None:
                self.before_batch()
            if (
                self._iter is None
                or self._next_index > self.position
                or (self.batches_per_epoch and self.position >= self._epoch_end)
            ):
                self._open(self.position)  # behind us (a rollback) or in another epoch: start over
            try:
                index, batch = self._advance()
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

    def _open(self, position: int) -> None:
        bpe = self.batches_per_epoch
        if self._iter is not None and bpe and self._next_index >= self._epoch_end:
            self._finish_epoch()  # read to its end: its end-of-epoch code runs, as unguarded
        epoch = position // bpe if bpe else 0
        first = epoch * bpe if bpe else 0
        self._epoch_end = first + bpe if bpe else 0
        if bpe and epoch > self._newest_epoch:
            self._newest_epoch = epoch
            if self.until_stopped and self.epochs is None:
                self._say_new_pass(epoch, first)
        self._iter = None  # (a worker pool of the old iterator shuts down with it)
        # Arriving at an epoch's start, the run's random streams stand where the unguarded
        # loader's would as it starts the epoch; entering mid-epoch (a rollback, a resume), the
        # restored streams already hold the epoch's draws.
        self._set_epoch(epoch, arriving=position == first)
        if self.on_open is not None:
            self.on_open()  # before iter(): workers draw indices as the iterator starts
        self._iter = iter(self.loader)
        self._next_index = first

    def _say_new_pass(self, epoch: int, first: int) -> None:
        """Another pass over the data to reach max_steps: a WARNING when skip windows made it needed."""
        bpe = self.batches_per_epoch or 0
        skipped = sum(
            max(0, min(b, first - 1) - max(a, first - bpe) + 1) for a, b in self.skip_ranges
        )
        if skipped:
            log.warning(
                "spikeguard: skip windows dropped %d batches of data epoch %d: re-reading the data "
                "from its start (data epoch %d) to reach max_steps",
                skipped,
                epoch - 1,
                epoch,
            )
        else:
            log.info("spikeguard: data epoch %d begins (reading on to max_steps)", epoch)

    def _advance(self) -> tuple[int, Any]:
        """The next batch at or after ``position`` outside the skip ranges; the ones before it are
        read and dropped with every random stream saved and put back."""
        batches = self._iter
        assert batches is not None  # (opened by the caller)
        saved = None
        try:
            while True:
                if self.batches_per_epoch and self._next_index >= self._epoch_end:
                    self._finish_epoch()
                    raise StopIteration
                index = self._next_index
                if index >= self.position and not self.skipped(index):
                    if saved is not None:
                        rng.restore(saved)
                        saved = None
                    batch = next(batches)
                    self._next_index += 1
                    if self.on_batch is not None:
                        self.on_batch(batch, True)
                    return index, batch
                if saved is None:
                    saved = rng.capture()
                dropped = next(batches)
                self._next_index += 1
                if self.on_batch is not None:
                    self.on_batch(dropped, False)
                self.dropped += 1
        finally:
            if saved is not None:
                rng.restore(saved)

    def _finish_epoch(self) -> None:
        """Pull once past the epoch's last batch, so that the loader's own end-of-epoch code runs
        (accelerate ends its gradient-accumulation bookkeeping there); a loader longer than its
        len() hands over a batch that is not this epoch's, dropped."""
        it, self._iter = self._iter, None
        if it is None:
            return
        saved = rng.capture()
        try:
            next(it)
        except StopIteration:
            pass
        finally:
            rng.restore(saved)

    def _set_epoch(self, epoch: int, arriving: bool = True) -> None:
        """Tell the loader which data epoch starts, and fix what it would draw from the global RNG."""
        loader = self.loader
        samplers = _samplers(loader)
        if callable(
            getattr(loader, "set_epoch", None)
        ):  # accelerate's DataLoaderShard passes it on
            loader.set_epoch(epoch)
        else:
            for s in samplers:
                if callable(getattr(s, "set_epoch", None)):  # DistributedSampler: seed + epoch
                    s.set_epoch(epoch)
        if self.seed is None:
            self.draws.enter(epoch, arriving)
            return
        for s in samplers:
            # A RandomSampler without a generator would draw a new seed from the global RNG at
            # every iter(): after a rollback that is another order. Seeded per epoch, in place
            # (accelerate keeps a reference to the generator to synchronise it across ranks).
            if isinstance(s, RandomSampler) and not callable(getattr(s, "set_epoch", None)):
                if s.generator is None:
                    s.generator = torch.Generator()
                s.generator.manual_seed(epoch_seed(self.seed, epoch))
        if isinstance(loader, DataLoader):
            # Every iter() draws the workers' base seed from this generator (else the global RNG).
            sampler_gens = [getattr(s, "generator", None) for s in samplers]
            if loader.generator is None:
                loader.generator = torch.Generator()
            if not any(loader.generator is g for g in sampler_gens):
                loader.generator.manual_seed(epoch_seed(self.seed, -1 - epoch))
