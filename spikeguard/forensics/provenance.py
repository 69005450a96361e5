"""Which sample ids went into each step's batch, for the last few hundred steps.

Two sources, in this order:
- a user-given ``sample_ids(batch) -> list`` (ids carried in the batch, a
  streaming dataset's own keys);
- a map-style ``DataLoader``'s sampler: its indices are the dataset indices.
  The loader is not rebuilt (it keeps its class, workers and device
  placement): the sampler inside its batch sampler is wrapped by a proxy that
  records each index as the loader draws it. A loader hands out batches in
  the order it drew their indices (``in_order``, the default), even with
  workers prefetching ahead, so each batch takes the next ``len(batch)``
  recorded indices.

Anything else (an iterable dataset, or a batch sampler other than torch's
own, without an id function) records nothing,
and ``inspect`` says so. Memory is bounded: ``StepSamples`` keeps ``window``
steps.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Callable, Iterator

SampleIds = Callable[[Any], list]


class _RecordingSampler:
    """Yields the wrapped sampler's indices unchanged, keeping a copy of each."""

    def __init__(self, inner: Any, drawn: deque) -> None:
        self.inner, self.drawn = inner, drawn

    def __iter__(self) -> Iterator[Any]:
        for index in self.inner:
            self.drawn.append(index)
            yield index

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(
        self, name: str
    ) -> Any:  # set_epoch, epoch, num_replicas, ...: the real sampler's
        return getattr(self.inner, name)


def _batch_len(batch: Any) -> int | None:
    if hasattr(batch, "shape") and len(batch.shape):
        return int(batch.shape[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    return None


class SampleIdTap:
    """Gives the sample ids of each batch a loader yields, in order."""

    def __init__(self, loader: Any, sample_ids: SampleIds | None = None) -> None:
        self.sample_ids = sample_ids
        self.drawn: deque = deque()
        self.source = "user" if sample_ids is not None else self._install(loader)

    def _install(self, loader: Any) -> str:
        from torch.utils.data import BatchSampler

        batch_sampler = getattr(loader, "batch_sampler", None)
        inner = getattr(batch_sampler, "sampler", None)
        # Only torch's own BatchSampler over a map-style dataset (0) is known to draw one index
        # per sample in batch order; another batch sampler (accelerate's shards, a bucketing
        # one) could yield other indices than it was handed: no ids rather than wrong ones.
        if (
            inner is None
            or type(batch_sampler) is not BatchSampler
            or getattr(loader, "_dataset_kind", 0) != 0
        ):
            return "none"
        if not isinstance(inner, _RecordingSampler):
            batch_sampler.sampler = _RecordingSampler(inner, self.drawn)
        else:
            self.drawn = inner.drawn
        return "sampler"

    def restart(self) -> None:
        """A new pass over the loader begins: indices drawn ahead by the last one are void."""
        self.drawn.clear()

    def ids(self, batch: Any) -> list | None:
        if self.sample_ids is not None:
            return list(self.sample_ids(batch))
        if self.source != "sampler":
            return None
        n = _batch_len(batch)
        if n is None or n > len(self.drawn):
            return None
        taken = [self.drawn.popleft() for _ in range(n)]
        return [int(i) if hasattr(i, "__index__") else i for i in taken]  # (tensor indices as ints)

    def skip(self, batch: Any) -> None:
        """A batch the wrapper drew and dropped (a skip window): its ids are consumed too."""
        self.ids(batch)


class StepSamples:
    """Step -> sample ids for the last ``window`` steps (oldest dropped first)."""

    def __init__(self, window: int = 512) -> None:
        self.window = window
        self.steps: OrderedDict[int, list] = OrderedDict()

    def record(self, step: int, ids: list | None) -> None:
        if ids is None:
            return
        self.steps[step] = ids
        self.steps.move_to_end(step)
        while len(self.steps) > self.window:
            self.steps.popitem(last=False)

    def between(self, first: int, last: int) -> list[dict]:
        return [
            {"step": s, "ids": ids} for s, ids in sorted(self.steps.items()) if first <= s <= last
        ]
