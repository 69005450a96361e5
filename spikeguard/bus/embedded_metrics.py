"""One ``/metrics`` for a trainer whose pipeline runs in a child process.

The pipeline's workers count into the child's registry; the trainer's own
series (the Guard's, the bridge's consumer lag) live in the trainer's. A
scrape of the trainer's port asks the child for its ``spikeguard_*``
families (over the bridge, :meth:`ChildPipeline.metrics`) and serves both
as one exposition. prometheus-client's multiprocess mode was not the fit:
it needs its directory in the environment before the interpreter starts,
and takes neither custom collectors (consumer lag) nor removing a run's
labels (``Metrics.forget_run``).

A family both processes have (every ``Metrics`` declares all of them) is
served once, its samples added up by name and labels: the two processes
count disjoint things, so a sum is each side's own value where only one
side has it, and the total where both do (a ``_created`` timestamp keeps
the older of the two).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample


def merged(families: Iterable[Metric]) -> list[Metric]:
    """``families`` with one family per name, the samples of same name and labels added up."""
    by_name: dict[str, Metric] = {}
    samples: dict[str, dict[tuple, Sample]] = {}
    for family in families:
        if family.name not in by_name:
            by_name[family.name] = Metric(
                family.name, family.documentation, family.type, family.unit
            )
            samples[family.name] = {}
        kept = samples[family.name]
        for sample in family.samples:
            key = (sample.name, tuple(sorted(sample.labels.items())))
            found = kept.get(key)
            if found is None:
                kept[key] = sample
            elif sample.name.endswith("_created"):  # a timestamp: the older one, never a sum
                kept[key] = found._replace(value=min(found.value, sample.value))
            else:
                kept[key] = found._replace(value=found.value + sample.value)
    for name, family in by_name.items():
        family.samples = list(samples[name].values())
    return list(by_name.values())


class CombinedCollector:
    """Collects ``local`` (the trainer's registry and collectors) and ``remote()`` as one."""

    def __init__(self, local: Iterable, remote: Callable[[], list[Metric]]) -> None:
        self.local = list(local)
        self.remote = remote

    def describe(self) -> list:
        return []  # nothing asked of the child when registered

    def collect(self) -> Iterator[Metric]:
        families: list[Metric] = []
        for source in self.local:
            families.extend(source.collect())
        families.extend(self.remote())
        yield from merged(families)


def combined_registry(local: Iterable, remote: Callable[[], list[Metric]]) -> CollectorRegistry:
    """A registry to serve: the trainer's ``local`` sources and the child's families, merged."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CombinedCollector(local, remote))
    return registry
