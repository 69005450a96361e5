"""The random draws a DataLoader makes as a data epoch starts: made as it would make them, and kept.

An unguarded ``for batch in loader`` draws from the global torch RNG at every
``iter()``: the workers' base seed (``_BaseDataLoaderIter.__init__``) and then,
as the first batch is fetched, the seed of a RandomSampler that has no
generator (``RandomSampler.__iter__``), both as
``torch.empty((), dtype=torch.int64).random_()``. So that a run the Guard
never acts on is exactly the user's run, the Guard makes those draws itself,
at the same point of the run and in the same order, and hands the results to
the loader through generators of its own (the loader then draws nothing from
the global RNG). What was drawn is kept per data epoch: an epoch entered again
(a rollback, a resume) reads its batches in the same order. A generator the
user gave (the loader's or a sampler's) runs as it would unguarded; its state
at each epoch's start is kept instead.

All of it is the CPU generator's business: a DataLoader draws nothing from
CUDA's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler

#: Epochs whose generator states (5 KB each) are kept: a rollback reaches back fewer than this.
#: The samplers' seeds (one int per epoch) are kept for every epoch.
KEEP_STATES = 64


def samplers(loader: Any) -> list[Any]:
    """The loader's sampler objects (sampler, batch sampler, the batch sampler's sampler), once each."""
    found: list[Any] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for s in (
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
    ):
        if s is not None and not any(s is f for f in found):
            found.append(s)
    return found


def _draw_seed() -> int:
    """One draw from the global RNG, the very call DataLoader and RandomSampler make."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


class EpochDraws:
    """Per data epoch, what the loader draws as the epoch starts; ``enter`` hands it to the loader."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.records: dict[int, dict[str, Any]] = {}
        # Decided once, before any generator of the Guard's is handed in: which draws come from
        # the global RNG (the Guard makes those) and which from the user's generators.
        self._dataloader = isinstance(loader, DataLoader)
        self._own_base = self._dataloader and loader.generator is None
        self._workers = self._dataloader and loader.num_workers > 0
        self._base: torch.Generator | None = None
        self._samplers = [
            s
            for s in samplers(loader)
            if isinstance(s, RandomSampler) and not callable(getattr(s, "set_epoch", None))
        ]
        self._own_sampler = [s.generator is None for s in self._samplers]

    def enter(self, epoch: int, arriving: bool) -> None:
        """Data epoch ``epoch`` starts to be read. ``arriving``: the run reached the epoch's start, so
        the global RNG stands where the unguarded loader's draws would be made; otherwise (entering
        mid-epoch) the restored streams already hold them and nothing is drawn from them."""
        record = self.records.get(epoch)
        if arriving or record is None:
            kept = None if arriving else torch.get_rng_state()
            drawn = self._draw()
            if kept is not None:
                torch.set_rng_state(kept)
            if record is None:
                record = self.records[epoch] = drawn
                self._forget_old_states(epoch)
        self._install(record)

    def _draw(self) -> dict[str, Any]:
        """What the loader would draw, in its order: the base seed at iter(), then the samplers'."""
        base = None
        # Persistent workers keep their iterator: the loader draws their base seed at its first
        # iter() only.
        persisted = self._workers and getattr(self.loader, "persistent_workers", False)
        if self._own_base and not (
            persisted and getattr(self.loader, "_iterator", None) is not None
        ):
            # The workers' base seed (the unguarded draw, kept as a generator state when workers
            # use it); without workers it seeds nothing, and only the global stream's advance counts.
            base = torch.get_rng_state() if self._workers else None
            _draw_seed()
        elif self._dataloader:
            base = self.loader.generator.get_state()
        drawn = [
            _draw_seed() if own else s.generator.get_state()
            for s, own in zip(self._samplers, self._own_sampler, strict=True)
        ]
        return {"base": base, "samplers": drawn}

    def _install(self, record: dict[str, Any]) -> None:
        """An int is a seed drawn for a generator of the Guard's; a tensor a generator's state."""
        base = record.get("base")
        if self._own_base:
            if self._base is None:
                self._base = torch.Generator()
            self.loader.generator = self._base
        if base is not None:
            self.loader.generator.set_state(base)
        # (a record without the samplers' draws installs none of them)
        for s, drawn in zip(self._samplers, record.get("samplers", ()), strict=False):
            if isinstance(drawn, int):
                if s.generator is None:  # made once, seeded in place: accelerate holds a reference
                    s.generator = torch.Generator()
                s.generator.manual_seed(drawn)
            elif drawn is not None:
                s.generator.set_state(drawn)

    def _forget_old_states(self, newest: int) -> None:
        old = self.records.get(newest - KEEP_STATES)
        if old is not None:
            old["base"] = None
            old["samplers"] = [d if isinstance(d, int) else None for d in old["samplers"]]

    def state_dict(self) -> dict[int, dict[str, Any]]:
        return {e: dict(r) for e, r in self.records.items()}

    def load_state_dict(self, state: dict[Any, dict[str, Any]]) -> None:
        """Merged: an epoch's record, once made, is never replaced (it is the order it was read in)."""
        for epoch, record in state.items():
            self.records.setdefault(int(epoch), dict(record))
