"""The ML detector's healthy rows since its last fit, packed: 4 bytes a value.

Kept as a list of 5-float numpy rows they cost 152 bytes a row (the array's
header is most of it); here a row is 20 bytes. float32 loses nothing: the
forest is grown and walked on float32 features (what sklearn makes of them),
and a row is rounded to 4 decimals first, which :meth:`Rows.tolist` gives back
for JSON. Rows are only ever appended; a refit starts a new buffer. So a
rollback snapshot can share a buffer and remember how many rows it had
(:meth:`prefix` makes a buffer of its own from that).
"""

from __future__ import annotations

from array import array

import numpy as np


def as_json(rows: np.ndarray) -> list[list[float]]:
    """float32 rows as the 4-decimal floats they were rounded to (exact back in float32)."""
    return np.round(np.asarray(rows, dtype=np.float32).astype(np.float64), 4).tolist()


class Rows:
    """Rows of ``width`` float32 values, appended one at a time."""

    __slots__ = ("width", "_data")

    def __init__(self, width: int) -> None:
        self.width = width
        self._data = array("f")

    def __len__(self) -> int:
        return len(self._data) // self.width

    def append(self, row: np.ndarray) -> None:
        """Add ``row`` (``width`` values, stored as float32)."""
        self._data.frombytes(np.asarray(row, dtype=np.float32).tobytes())

    def prefix(self, count: int) -> Rows:
        """A buffer of its own holding the first ``count`` rows."""
        twin = Rows(self.width)
        twin._data = self._data[: count * self.width]
        return twin

    def freeze(self) -> np.ndarray:
        """The rows as a float32 ``(len, width)`` array sharing this buffer, which stops growing.

        After a refit the buffer's rows are the new forest's rows too: shared, not copied, so
        that snapshots from before the refit hold them once.
        """
        return np.frombuffer(self._data, dtype=np.float32).reshape(-1, self.width)

    def matrix(self) -> np.ndarray:
        """The rows as a float32 ``(len, width)`` array (a copy: appending later is still allowed)."""
        return np.array(self._data, dtype=np.float32).reshape(-1, self.width)

    def tolist(self) -> list[list[float]]:
        return as_json(self.matrix())

    @classmethod
    def from_rows(cls, width: int, rows: list[list[float]]) -> Rows:
        out = cls(width)
        if rows:
            out._data.frombytes(np.asarray(rows, dtype=np.float64).astype(np.float32).tobytes())
        return out
