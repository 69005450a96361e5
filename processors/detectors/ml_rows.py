"""The ML detector's healthy rows since its last fit, packed: 8 bytes a value.

Kept as a list of 5-float numpy rows they cost 152 bytes a row (the array's
header is most of it), and a run gathers up to ``refit_every`` of them between
fits (3000 once the buffer is full: 456 kB a run, against 120 kB here). Rows
are only ever appended; a refit starts a new buffer. So a rollback snapshot
can share a buffer and remember how many rows it had (:meth:`prefix` makes a
buffer of its own from that).
"""

from __future__ import annotations

from array import array

import numpy as np


class Rows:
    """Rows of ``width`` float64 values, appended one at a time."""

    __slots__ = ("width", "_data")

    def __init__(self, width: int) -> None:
        self.width = width
        self._data = array("d")

    def __len__(self) -> int:
        return len(self._data) // self.width

    def append(self, row: np.ndarray) -> None:
        """Add ``row`` (``width`` values; copied, bit for bit)."""
        self._data.frombytes(np.asarray(row, dtype=np.float64).tobytes())

    def prefix(self, count: int) -> Rows:
        """A buffer of its own holding the first ``count`` rows."""
        twin = Rows(self.width)
        twin._data = self._data[: count * self.width]
        return twin

    def matrix(self) -> np.ndarray:
        """The rows as a ``(len, width)`` array (a copy: appending later is still allowed)."""
        return np.array(self._data, dtype=np.float64).reshape(-1, self.width)

    def tolist(self) -> list[list[float]]:
        values, w = self._data.tolist(), self.width
        return [values[i : i + w] for i in range(0, len(values), w)]

    @classmethod
    def from_rows(cls, width: int, rows: list[list[float]]) -> Rows:
        out = cls(width)
        for row in rows:
            out.append(np.array(row, dtype=np.float64))
        return out
