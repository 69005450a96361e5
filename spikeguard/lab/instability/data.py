"""The lab's text: the source of a few standard-library modules, as characters.

It ships with Python, so nothing is downloaded and nothing is stored in the
repository, and it is code, so a character model has structure to learn in a
few hundred steps (the recovery benchmark trains on the same kind of text).
A seeded generator draws the batches, so a run is the same every time.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import typing
from pathlib import Path

import torch

SOURCES = (argparse, collections, dataclasses, enum, typing)


class CharText:
    """Train and held-out character ids of :data:`SOURCES`, and seeded batches of them."""

    def __init__(self, block: int) -> None:
        text = "\n".join(Path(str(m.__file__)).read_text(encoding="utf-8") for m in SOURCES)
        text = "".join(c if 32 <= ord(c) < 127 or c == "\n" else " " for c in text)
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([index[c] for c in text], dtype=torch.long)
        split = int(len(ids) * 0.9)
        self.train, self.held, self.block = ids[:split], ids[split:], block

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(
        self, size: int, generator: torch.Generator, held: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``size`` random windows: inputs and the next-character targets."""
        ids = self.held if held else self.train
        starts = torch.randint(0, len(ids) - self.block - 1, (size,), generator=generator)
        rows = torch.stack([ids[s : s + self.block + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]
