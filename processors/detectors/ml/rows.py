"""The ML detector's healthy rows since its last fit, packed: 4 bytes a value.

Kept as a list of 5-float numpy rows they cost 152 bytes a row (the array's
header is most of it); here a row is 20 bytes, in one numpy block. float32 loses nothing: the
forest is grown and walked on float32 features (what sklearn makes of them),
and a row is rounded to 4 decimals first, which :meth:`Rows.tolist` gives back
for JSON. Rows are only ever appended; a refit starts a new buffer. So a
rollback snapshot can share a buffer and remember how many rows it had
(:meth:`prefix` makes a buffer of its own from that).
"""

from __future__ import annotations

import numpy as np


def as_json(rows: np.ndarray) -> list[list[float]]:
    """float32 rows as the 4-decimal floats they were rounded to (exact back in float32)."""
    return np.round(np.asarray(rows, dtype=np.float32).astype(np.float64), 4).tolist()


class Rows:
    """Rows of ``width`` float32 values, appended one at a time (a numpy block grown by 1/4)."""

    __slots__ = ("width", "limit", "_data", "_count")

    def __init__(self, width: int, limit: int = 0) -> None:
        self.width = width
        self.limit = limit  # rows it is expected to hold at most: it grows to that, not past
        self._data = np.empty((0, width), dtype=np.float32)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def append(self, row: np.ndarray) -> None:
        """Add ``row`` (``width`` values, stored as float32)."""
        n = self._count
        if n == len(self._data):  # a new block: views handed out keep the old one
            size = max(16, n + n // 4)
            if n < self.limit < size:
                size = self.limit
            grown = np.empty((size, self.width), dtype=np.float32)
            grown[:n] = self._data[:n]
            self._data = grown
        self._data[n] = row
        self._count = n + 1

    def prefix(self, count: int) -> Rows:
        """A buffer of its own holding the first ``count`` rows."""
        twin = Rows(self.width, self.limit)
        twin._data = self._data[:count].copy()
        twin._count = count
        return twin

    def freeze(self) -> np.ndarray:
        """The rows as a float32 ``(len, width)`` view of this buffer, which must not grow after.

        After a refit the buffer's rows are the new forest's rows too: shared, not copied, so
        that snapshots from before the refit hold them once.
        """
        return self._data[: self._count]

    def moved_to(self, copy: np.ndarray) -> None:
        """Hold ``copy`` (the same rows, elsewhere) instead of its own block, and stop growing.

        A refit copies the rows into the next fit's block; snapshots that share this buffer
        then read them there, and its own block goes.
        """
        assert len(copy) == self._count and copy.shape[1] == self.width
        self._data = copy
        self.limit = self._count

    def matrix(self) -> np.ndarray:
        """The rows as a float32 ``(len, width)`` array (a copy: appending later is still allowed)."""
        return self._data[: self._count].copy()

    def tolist(self) -> list[list[float]]:
        return as_json(self._data[: self._count])

    @classmethod
    def from_rows(cls, width: int, rows: list[list[float]], limit: int = 0) -> Rows:
        out = cls(width, limit)
        if rows:
            out._data = np.asarray(rows, dtype=np.float64).astype(np.float32).reshape(-1, width)
            out._count = len(out._data)
        return out


class Arena:
    """An append-only block of rows that successive early fits take windows of.

    While the buffer fills, a refit comes every ``warmup_steps`` rows and takes the
    previous fit's rows plus the new ones: as copies, each fit's rows were a new array
    that the rollback snapshots of its steps kept alive (~60 kB of them a run). As windows
    of one block they share it. A block is only written past its last window, and only
    by the state holding that window (``last``), so no window a snapshot holds ever changes.
    """

    __slots__ = ("data", "filled", "last")

    def __init__(self, capacity: int, width: int) -> None:
        self.data = np.empty((capacity, width), dtype=np.float32)
        self.filled = 0
        self.last: np.ndarray | None = None  # the newest window handed out

    @classmethod
    def extend(
        cls, arena: Arena | None, fitted: np.ndarray, rows: np.ndarray, size: int, capacity: int
    ) -> tuple[Arena, np.ndarray]:
        """The newest ``size`` rows of ``fitted`` then ``rows``, as a window of ``arena`` if
        ``fitted`` is its newest window and there is room, else of a new block of ``capacity``
        rows (``buffer_size`` plus a refit's rows: the fit that fills the buffer fits too);
        and the block."""
        if arena is None or arena.last is not fitted or arena.filled + len(rows) > len(arena.data):
            arena = cls(max(capacity, len(fitted) + len(rows)), fitted.shape[1])
            arena.data[: len(fitted)] = fitted
            arena.filled = len(fitted)
        end = arena.filled + len(rows)
        arena.data[arena.filled : end] = rows
        arena.filled = end
        arena.last = arena.data[max(0, end - size) : end]
        return arena, arena.last
