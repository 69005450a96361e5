"""A loss-curve PNG without matplotlib: a tiny numpy rasteriser and zlib.

Draws the loss (per step, as trained: re-run steps after a rollback in a
second colour), red vertical bands where the pipeline saw anomalies, orange
marks where actions were applied, blue lines at rollbacks, axes with ticks,
and a legend of coloured boxes. No text: the colours are the legend.
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Sequence

import numpy as np

WHITE, BLACK, GREY = (255, 255, 255), (40, 40, 40), (200, 200, 200)
LOSS, RERUN = (31, 119, 180), (44, 160, 44)
ANOMALY, ACTION, ROLLBACK = (250, 200, 200), (255, 127, 14), (120, 60, 200)


def write_png(path: str, image: np.ndarray) -> None:
    """``image``: uint8 array (height, width, 3)."""
    h, w, _ = image.shape
    raw = b"".join(b"\x00" + image[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    with open(path, "wb") as handle:
        handle.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                     + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


class Canvas:
    def __init__(self, width: int = 900, height: int = 420, margin: int = 40) -> None:
        self.w, self.h, self.m = width, height, margin
        self.img = np.full((height, width, 3), 255, dtype=np.uint8)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: tuple) -> None:
        x0, x1 = sorted((max(0, x0), min(self.w - 1, x1)))
        y0, y1 = sorted((max(0, y0), min(self.h - 1, y1)))
        self.img[y0:y1 + 1, x0:x1 + 1] = color

    def line(self, x0: float, y0: float, x1: float, y1: float, color: tuple) -> None:
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        xs = np.clip(np.round(np.linspace(x0, x1, n)).astype(int), 0, self.w - 1)
        ys = np.clip(np.round(np.linspace(y0, y1, n)).astype(int), 0, self.h - 1)
        self.img[ys, xs] = color

    def marker(self, x: float, y: float, color: tuple, r: int = 3) -> None:
        self.rect(int(x) - r, int(y) - r, int(x) + r, int(y) + r, color)


def loss_plot(path: str, losses: Sequence[tuple[int, int, float]], anomalies: Sequence[int] = (),
              actions: Sequence[int] = (), rollbacks: Sequence[tuple[int, int]] = (),
              width: int = 900, height: int = 420) -> None:
    """``losses``: (step, epoch, loss) in training order; ``rollbacks``: (from_step, to_step)."""
    c = Canvas(width, height)
    m, pw, ph = c.m, width - 2 * c.m, height - 2 * c.m
    finite = [l for _, _, l in losses if math.isfinite(l)]
    steps = [s for s, _, _ in losses] or [0]
    s_max = max(max(steps), 1)
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    if finite:  # a spike of 1000x must not flatten the curve: cap at a high quantile
        hi = min(hi, float(np.quantile(finite, 0.98)) * 1.5)
    hi = hi if hi > lo else lo + 1.0

    def px(step: float) -> float:
        return m + pw * step / s_max

    def py(loss: float) -> float:
        v = min(max(loss, lo), hi) if math.isfinite(loss) else hi
        return m + ph * (1 - (v - lo) / (hi - lo))

    for step in anomalies:
        c.rect(int(px(step)) - 1, m, int(px(step)) + 1, m + ph, ANOMALY)
    for frac in (0.25, 0.5, 0.75):  # grid
        c.line(m, m + ph * frac, m + pw, m + ph * frac, GREY)
    prev = None
    for step, epoch, loss in losses:
        point = (px(step), py(loss))
        color = LOSS if epoch == 0 else RERUN
        if prev is not None and prev[2] == epoch and step == prev[3] + 1:
            c.line(prev[0], prev[1], point[0], point[1], color)
        if not math.isfinite(loss):
            c.marker(point[0], m + 4, (214, 39, 40), 4)
        prev = (point[0], point[1], epoch, step)
    for step in actions:
        c.marker(px(step), m + ph - 6, ACTION)
    for start, end in rollbacks:
        c.line(px(start), m, px(start), m + ph, ROLLBACK)
        c.line(px(end), m + 8, px(start), m + 8, ROLLBACK)
    c.line(m, m + ph, m + pw, m + ph, BLACK)  # axes and ticks
    c.line(m, m, m, m + ph, BLACK)
    for i in range(11):
        x = m + pw * i / 10
        c.line(x, m + ph, x, m + ph + 5, BLACK)
        y = m + ph * i / 10
        c.line(m - 5, y, m, y, BLACK)
    for i, color in enumerate((LOSS, RERUN, ANOMALY, ACTION, ROLLBACK)):  # legend boxes
        x = width - m - 5 * 18 + i * 18
        c.rect(x, 8, x + 12, 20, color)
    write_png(path, c.img)
