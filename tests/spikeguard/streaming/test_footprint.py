"""deep_size counts what a numpy view keeps alive: its base.

A view's own ``sys.getsizeof`` is its header (~112 bytes), yet it keeps the
whole array it views in memory. The ML detector's compiled forest (five
``ravel()`` views of ~100 kB each) counted 1.5 kB instead of ~500 kB.
"""

from __future__ import annotations

import numpy as np

from spikeguard.streaming.footprint import deep_size


def test_a_view_counts_the_array_it_keeps_alive() -> None:
    whole = np.zeros((1000, 10))
    view = whole[-10:]
    assert deep_size(view) >= whole.nbytes
    assert deep_size(np.zeros((100, 10)).ravel()) >= 8000


def test_a_base_shared_by_views_counts_once() -> None:
    whole = np.zeros(10_000)
    assert deep_size([whole[:10], whole[10:20], whole]) < 2 * whole.nbytes
