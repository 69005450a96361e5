"""The decisions a recovery policy admitted lately: a duplicate told from a late arrival.

A decision at or behind the newest step handled is ignored either way; the
policy counts it as a ``duplicate`` when its id is one it admitted within the
last ``seen_window_steps`` steps of this epoch, else as ``late``. Kept as an
``OrderedDict`` of id text to step, that window cost ~180 bytes a decision:
~178 kB a run at the default 1000 steps, 1.7 GiB for the 10,000 runs a worker
should hold in 1 GiB (docs/benchmarks.md). Here a decision is two 8-byte slots of two
arrays: its step, and 64 bits of a BLAKE2b hash of its id (stable across
processes, unlike ``hash()``, so a saved state reads back the same anywhere).
Two ids agreeing on 64 bits would take ~2**32 decisions in one window.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b
from typing import Any


def decision_key(decision_id: str) -> int:
    """The 64 bits of ``decision_id`` that stand for it (signed, to fit an ``array('q')``)."""
    digest = blake2b(decision_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class SeenDecisions:
    """Decision keys and their steps, oldest first, within a window of steps."""

    __slots__ = ("_steps", "_keys")

    def __init__(self) -> None:
        self._steps = array("q")
        self._keys = array("q")

    def __len__(self) -> int:
        return len(self._steps)

    def __contains__(self, decision_id: object) -> bool:
        return isinstance(decision_id, str) and decision_key(decision_id) in self._keys

    def add(self, decision_id: str, step: int, window: int) -> None:
        """Remember ``decision_id`` at ``step``; forget the oldest, before ``step - window``."""
        self._steps.append(step)
        self._keys.append(decision_key(decision_id))
        oldest, steps = step - window, self._steps
        drop = 0
        while drop < len(steps) and steps[drop] < oldest:  # as old as the oldest, in order added
            drop += 1
        if drop:
            del self._steps[:drop], self._keys[:drop]

    def clear(self) -> None:
        del self._steps[:], self._keys[:]

    def copy(self) -> SeenDecisions:
        """An independent copy: two array copies (a batch's undo point), not a list of pairs."""
        twin = SeenDecisions()
        twin._steps, twin._keys = self._steps[:], self._keys[:]
        return twin

    def state_dict(self) -> list[list[int]]:
        """``[key, step]`` pairs, oldest first."""
        return [[key, step] for key, step in zip(self._keys, self._steps)]

    def load_state_dict(self, pairs: list[list[Any]]) -> None:
        """Adopt :meth:`state_dict`'s pairs; an id's text (a state saved before keys) is hashed."""
        if isinstance(pairs, SeenDecisions):  # a copy (RecoveryPolicy.undo_state): copied again
            self._steps, self._keys = pairs._steps[:], pairs._keys[:]
            return
        self.clear()
        for ident, step in pairs:
            self._keys.append(decision_key(ident) if isinstance(ident, str) else int(ident))
            self._steps.append(int(step))
