"""Leave named samples out of a loader: ``guard.data(loader, skip_ids=...)``.

The ids are what ``spikeguard inspect`` ranks and writes as ``skip_ids``
(dataset indices of a map-style ``DataLoader``). The loader is not rebuilt:
the sampler inside its batch sampler is wrapped by one that passes over those
indices, so batches keep their size, the order of the rest stays the
sampler's, and the sample-id tap of forensics (which wraps the same sampler)
records what was actually drawn. Only samplers known to yield every index of
the dataset once per pass (``SequentialSampler``, ``RandomSampler`` without
replacement) are wrapped, so the loader's length stays exact; anything else
is refused with the reason rather than skipped wrongly.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from spikeguard.errors import ConfigError

log = logging.getLogger("spikeguard.producers.guard")

SkipIds = str | os.PathLike | Iterable[int]


class SkipIdsError(ConfigError):
    """A skip list that cannot be read, or a loader it cannot be applied to."""


class _SkippingSampler:
    """Yields the wrapped sampler's indices except the skipped ones."""

    def __init__(self, inner: Any, skipped: frozenset[int], length: int) -> None:
        self.inner, self.skipped, self.length = inner, skipped, length

    def __iter__(self) -> Iterator[Any]:
        skipped = self.skipped
        for index in self.inner:
            if int(index) not in skipped:
                yield index

    def __len__(self) -> int:
        return self.length

    def __getattr__(self, name: str) -> Any:  # generator, set_epoch, ...: the real sampler's
        return getattr(self.inner, name)


def read_skip_ids(source: SkipIds) -> frozenset[int]:
    """The ids of an inspect report (its ``skip_ids``), a JSON list file, or an iterable of ids."""
    if not isinstance(source, (str, os.PathLike)):
        try:
            return frozenset(int(i) for i in source)
        except (TypeError, ValueError) as exc:
            raise SkipIdsError(f"skip_ids: expected dataset indices (ints), got {exc}") from None
    path = Path(source)
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SkipIdsError(f"skip_ids {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise SkipIdsError(f"skip_ids {path}: not readable JSON ({exc})") from None
    ids = body.get("skip_ids") if isinstance(body, dict) else body
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        raise SkipIdsError(
            f"skip_ids {path}: expected spikeguard inspect's report (a 'skip_ids' "
            "list) or a JSON list of dataset indices"
        )
    return frozenset(ids)


def leave_out(loader: Any, source: SkipIds) -> int:
    """Make ``loader`` pass over the samples ``source`` names; returns how many it will skip."""
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    from spikeguard.forensics.provenance import _RecordingSampler

    skipped = read_skip_ids(source)
    batch_sampler: Any = getattr(loader, "batch_sampler", None)
    holder: Any = batch_sampler
    inner: Any = getattr(batch_sampler, "sampler", None)
    if isinstance(
        inner, _RecordingSampler
    ):  # forensics' tap stays outermost: it sees what is drawn
        holder, inner = inner, inner.inner
    if isinstance(inner, _SkippingSampler):
        inner = inner.inner  # a second skip list replaces the first
    every_index_once = isinstance(inner, SequentialSampler) or (
        isinstance(inner, RandomSampler) and not inner.replacement and inner._num_samples is None
    )
    if (
        type(batch_sampler) is not BatchSampler
        or getattr(loader, "_dataset_kind", 0) != 0
        or not every_index_once
    ):
        raise SkipIdsError(
            f"skip_ids needs a DataLoader over a map-style dataset with a SequentialSampler or a "
            f"RandomSampler without replacement (its ids are dataset indices); this loader's "
            f"sampler is {type(inner).__name__}"
        )
    size = len(inner.data_source)
    present = sum(1 for i in skipped if 0 <= i < size)
    holder.sampler = _SkippingSampler(inner, skipped, size - present)
    shown = ", ".join(map(str, sorted(skipped)[:10])) + (", ..." if len(skipped) > 10 else "")
    where = f" named in {source}" if isinstance(source, (str, os.PathLike)) else ""
    log.warning("spikeguard: leaving out %d sample(s)%s (skip_ids): %s", present, where, shown)
    return present
