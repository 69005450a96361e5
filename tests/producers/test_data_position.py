"""The data wrapper: global batch index, exact resume, skips, order independent of rollbacks."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from spikeguard.producers import GuardedLoader


def _loader(n=40, batch_size=4, shuffle=True, drop_last=False):
    return DataLoader(
        TensorDataset(torch.arange(n)), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last
    )


def _take(wrapper, k):
    out = []
    for (batch,) in wrapper:
        out.append((wrapper.last_index, batch.tolist()))
        if len(out) == k:
            break
    return out


def test_order_is_fixed_by_seed_and_epoch():
    a = GuardedLoader(_loader(), seed=7, epochs=3)
    b = GuardedLoader(_loader(), seed=7, epochs=3)
    first, second = _take(a, 30), _take(b, 30)
    assert first == second and [i for i, _ in first] == list(range(30))
    epochs = [
        sorted(x for _, batch in first[e * 10 : (e + 1) * 10] for x in batch) for e in range(3)
    ]
    assert all(e == list(range(40)) for e in epochs)  # every sample once per epoch
    assert first[:10] != first[10:20]  # a new permutation per epoch
    assert _take(GuardedLoader(_loader(), seed=8, epochs=1), 10) != first[:10]


def test_resume_at_any_index_yields_what_an_uninterrupted_run_sees():
    reference = dict(_take(GuardedLoader(_loader(), seed=1, epochs=3), 30))
    for start in (0, 3, 9, 10, 17, 29):
        w = GuardedLoader(_loader(), seed=1, epochs=3)
        _take(w, 5)  # wander off, then seek (what a rollback does)
        w.seek(start)
        got = _take(w, 30 - start)
        assert got == [(i, reference[i]) for i in range(start, 30)]


def test_order_does_not_depend_on_rollbacks_or_global_rng():
    reference = _take(GuardedLoader(_loader(), seed=2, epochs=2), 20)
    w = GuardedLoader(_loader(), seed=2, epochs=2)
    seen, rolled = {}, 0
    for (batch,) in w:
        torch.rand(3)  # the training loop consumes the global RNG
        seen[w.last_index] = batch.tolist()
        if w.last_index in (12, 15) and rolled < 2:
            rolled += 1
            w.seek(4 if rolled == 1 else 11)  # rolled back (twice)
    assert [(i, seen[i]) for i in range(20)] == reference


def test_skip_ranges_are_jumped_and_survive_a_seek():
    w = GuardedLoader(_loader(), seed=3, epochs=2)
    reference = dict(_take(GuardedLoader(_loader(), seed=3, epochs=2), 20))
    w.skip(5, 7)
    w.skip(9, 11)  # crosses the epoch boundary at 10
    got = _take(w, 20)
    assert [i for i, _ in got] == [0, 1, 2, 3, 4, 8, 12, 13, 14, 15, 16, 17, 18, 19]
    assert all(reference[i] == batch for i, batch in got)
    w.seek(6)
    assert [i for i, _ in _take(w, 2)] == [8, 12]
    state = w.state_dict()
    assert state["skip_ranges"] == [[5, 7], [9, 11]] and state["position"] == 13


def test_one_pass_per_iter_like_a_dataloader():
    w = GuardedLoader(_loader(n=12, batch_size=4), seed=0)
    assert len(w) == 3
    assert [w.last_index for _ in w] == [0, 1, 2]
    assert [w.last_index for _ in w] == [3, 4, 5]  # the next data epoch


def test_drop_last_and_sequential_order():
    w = GuardedLoader(_loader(n=10, batch_size=4, shuffle=False, drop_last=True), seed=0, epochs=1)
    assert [b.tolist() for (b,) in w] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_plain_iterables_are_replayed():
    data = [[i] for i in range(6)]
    w = GuardedLoader(data, seed=0, epochs=2)
    w.skip(2, 3)
    assert [(w.last_index, b) for b in w] == [
        (0, [0]),
        (1, [1]),
        (4, [4]),
        (5, [5]),
        (6, [0]),
        (7, [1]),
        (8, [2]),
        (9, [3]),
        (10, [4]),
        (11, [5]),
    ]
    w.seek(7)
    w.epochs = None
    assert [b for b in w] == [[1], [2], [3], [4], [5]]


def test_distributed_sharding_gives_disjoint_batches():
    ds = TensorDataset(torch.arange(32))
    shards = []
    for rank in (0, 1):
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True)
        w = GuardedLoader(DataLoader(ds, batch_size=4, sampler=sampler), seed=5, epochs=1)
        shards.append([b.tolist() for (b,) in w])
    assert len(shards[0]) == len(shards[1]) == 4
    for a, b in zip(*shards):
        assert not set(a) & set(b)
    assert sorted(x for shard in shards for batch in shard for x in batch) == list(range(32))
