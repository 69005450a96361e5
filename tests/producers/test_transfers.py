"""A whole ``guard.step`` costs one device-to-host transfer, not one per parameter or per check.

Every way Python can read a tensor's values on the host is counted
(``item``, ``tolist``, ``cpu``, ``numpy`` and the ``float``/``int``/``bool``/
``index`` conversions). The optimizer is plain SGD, which reads none itself,
so every count is the Guard's: statistics, the local skip rule, adaptive
clipping and the publishing of the step event included. Counted on the
training thread: on the CPU the publisher's thread picks the top per-layer
norms from their vector in host memory (stats.LayerNorms), no transfer.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from producers_helpers import Tiny, make_guard

READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


class _Reads:
    """Counts host reads of tensor values while active (patched on torch.Tensor)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        self.active = False
        self.thread = threading.get_ident()  # the training thread's reads
        for name in READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                if self.active and threading.get_ident() == self.thread:
                    self.counts[_name] += 1
                return _original(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def _sgd_tiny() -> Tiny:
    tiny = Tiny()
    tiny.optimizer = torch.optim.SGD(tiny.model.parameters(), lr=1e-2)
    return tiny


@pytest.mark.parametrize(
    "config",
    [
        {},  # the defaults: statistics, skip rule, event
        {"param_norm": True, "update_norm": True},  # the optional norms ride along in the same read
        {"skip_outliers": False},
        {"top_k_layers": 2},
    ],
)
def test_guard_step_reads_the_device_once(bus, tmp_path, monkeypatch, config):
    tiny = _sgd_tiny()
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=0, **config)
    reads = _Reads(monkeypatch)
    batches = iter(guard.data(tiny.loader))
    for _ in range(40):  # past every warm-up (skip rule, adaptive clipping)
        guard.step(tiny.loss(next(batches)))
    steps = 20
    per_step = []
    for _ in range(steps):
        loss = tiny.loss(next(batches))
        before = sum(reads.counts.values())
        reads.active = True
        guard.step(loss)
        reads.active = False
        per_step.append(sum(reads.counts.values()) - before)
    guard.close()
    assert per_step == [1] * steps, reads.counts
    assert reads.counts == {"tolist": steps}


def test_counting_sees_a_transfer_where_there_is_one(monkeypatch):
    # The counter itself: a per-parameter .item() loop is what it must catch.
    tiny = _sgd_tiny()
    tiny.loss(next(iter(tiny.loader)))
    reads = _Reads(monkeypatch)
    reads.active = True
    norms = [p.grad.norm().item() for p in tiny.model.parameters()]
    float(torch.tensor(1.0))
    assert reads.counts == {"item": len(norms), "__float__": 1}
