"""The Guard's state as a dict of Stateful parts, as torchtitan's CheckpointManager holds it.

Each part speaks ``state_dict()`` / ``load_state_dict()``. A checkpoint is
``{name: part.state_dict()}``; a rollback or a restart loads each part back
from the same names, in the dict's order (the model before the optimizer that
refers to its parameters; the data position last, because it merges skip
ranges into what is already there). Nothing here reaches into a part's
private fields, so a new part (a user's own Stateful) is one dict entry.

With several ranks, rank 0 saves every part and each other rank only the
parts that differ per rank (its RNG streams): the rest is identical.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Protocol, runtime_checkable

import torch

from spikeguard.producers import rng
from spikeguard.producers.actions import ActionFailed
from spikeguard.producers.data import merge_ranges


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class BatchSource(Protocol):
    """The batches a run reads, as :class:`DataPosition` follows them: the Guard's own
    :class:`~spikeguard.producers.data.GuardedLoader`, or a framework's stream
    (external_loop.BatchStream)."""

    #: The global index of the last batch handed out (None: none yet).
    last_index: int | None
    #: The last pass ended at the end of the data (not by a stop).
    ran_out: bool
    #: The global batch indices never to be read, as merged ``[first, last]`` ranges.
    skip_ranges: list[list[int]]

    def take_span(self) -> tuple[int, int, int]: ...

    def skip(self, start: int, end: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ModelPart:
    """The model; a restored model carries no gradients of the step that was abandoned."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)
        for p in self.model.parameters():
            p.grad = None


class RNGPart:
    """Every random stream the program uses (torch, CUDA, Python, numpy if loaded)."""

    def state_dict(self) -> dict[str, Any]:
        return rng.capture()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng.restore(state)


class DataPosition:
    """Where the data stands: next global batch index, skip ranges, and which step read what.

    Before ``guard.data(loader)`` is called (e.g. on resume) the state waits
    here and is handed to the loader when it arrives. Skip ranges are merged,
    never replaced: neither a rollback nor a restart may forget bad data.
    Per step it remembers the span of batch indices the step consumed (several
    with gradient accumulation), for the last ``keep`` steps, so a skip window
    given in steps becomes a range of batches.
    """

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self.loader: BatchSource | None = None
        self.pending: dict[str, Any] | None = None
        self.spans: OrderedDict[int, tuple[int, int]] = OrderedDict()  # step -> (first, last) batch
        self.old_spans: dict[int, tuple[int, int]] = {}  # the same, as before the last rollback

    def attach(self, loader: BatchSource) -> None:
        self.loader = loader
        if self.pending is not None:
            loader.load_state_dict(self.pending)
            self.pending = None

    @property
    def skip_ranges(self) -> list[list[int]]:
        return self.state_dict().get("skip_ranges", [])

    def record(self, step: int) -> int:
        """Note the batches ``step`` consumed; returns how many (micro-batches)."""
        if self.loader is None:
            return 0
        first, last, count = self.loader.take_span()
        if count:
            self.spans[step] = (first, last)
            while len(self.spans) > self.keep:
                self.spans.popitem(last=False)
        return count

    def rewind(self, step: int) -> None:
        """A rollback to ``step``: steps from there on are to be run again."""
        self.old_spans = dict(self.spans)
        for s in [s for s in self.spans if s >= step]:
            del self.spans[s]

    def skip_steps(
        self, from_step: int, to_step: int, extra: int = 0, after_rollback: bool = False
    ) -> tuple[int, int, int]:
        """Skip the batches steps ``from_step..to_step`` read, plus ``extra`` steps' worth after.

        Returns ``(first batch, last batch, optimizer steps covered)``.
        """
        if to_step < from_step or extra < 0:
            raise ActionFailed(f"bad skip window {from_step}..{to_step} (+{extra})")
        first, second = (
            (self.old_spans, self.spans) if after_rollback else (self.spans, self.old_spans)
        )
        found = [first.get(s, second.get(s)) for s in range(from_step, to_step + 1)]
        known = [k for k in found if k is not None]
        if not known:
            raise ActionFailed(f"no batch index known for steps {from_step}..{to_step}")
        # With accumulation a step reads several batches: "extra" is in steps, like the window.
        per_step = max(1, round(sum(b - a + 1 for a, b in known) / len(known)))
        start, end = min(a for a, _ in known), max(b for _, b in known) + extra * per_step
        if self.loader is not None:
            self.loader.skip(start, end)
        else:
            state = self.pending or {"position": 0}
            state["skip_ranges"] = merge_ranges(list(state.get("skip_ranges", [])) + [[start, end]])
            self.pending = state
        return start, end, len(known) + extra

    def state_dict(self) -> dict[str, Any]:
        if self.loader is not None:
            return self.loader.state_dict()
        return dict(self.pending or {"position": 0, "skip_ranges": []})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.loader is not None:
            self.loader.load_state_dict(state)  # position from the checkpoint, skip ranges merged
        else:
            skips = list((self.pending or {}).get("skip_ranges", []))
            self.pending = dict(
                state, skip_ranges=merge_ranges(skips + list(state.get("skip_ranges", [])))
            )


class StateParts:
    """Named Stateful parts; ``per_rank`` names the parts every rank saves for itself."""

    def __init__(
        self, parts: Iterable[tuple[str, Stateful | None]], per_rank: Iterable[str] = ("rng",)
    ) -> None:
        self.parts: OrderedDict[str, Stateful] = OrderedDict(
            (n, p) for n, p in parts if p is not None
        )
        for name, part in self.parts.items():
            if not isinstance(part, Stateful):
                raise TypeError(
                    f"state part {name!r} ({type(part).__name__}) has no state_dict/load_state_dict"
                )
        self.per_rank = frozenset(per_rank)

    def __getitem__(self, name: str) -> Stateful:
        return self.parts[name]

    def __contains__(self, name: str) -> bool:
        return name in self.parts

    def names(self) -> list[str]:
        return list(self.parts)

    def state_dict(self, rank: int = 0) -> dict[str, Any]:
        return {
            name: part.state_dict()
            for name, part in self.parts.items()
            if rank == 0 or name in self.per_rank
        }

    def read(self, body: dict[str, Any], rank: int = 0) -> dict[str, Any]:
        """``body`` with what its parts keep outside it read into memory (a part's ``read_state``:
        a sharded model's DCP directory, a collective); loading it afterwards reads no file."""
        own = body.get("rank_state", {}) if rank else {}
        for name, part in self.parts.items():
            read_state = getattr(part, "read_state", None)
            source = own if rank and name in self.per_rank else body
            if read_state is not None and source.get(name) is not None:
                source[name] = read_state(source[name])
        return body

    def load_state_dict(self, body: dict[str, Any], rank: int = 0) -> None:
        """Load every part found in ``body``; a rank's own parts come from ``body["rank_state"]``."""
        own = body.get("rank_state", {}) if rank else {}
        for name, part in self.parts.items():
            # (a rank's own part never comes from rank 0's file: rank 0's random streams are not its own)
            state = own.get(name) if rank and name in self.per_rank else body.get(name)
            if state is not None:
                part.load_state_dict(state)
