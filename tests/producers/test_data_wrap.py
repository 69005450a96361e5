"""guard.data() wraps the user's own loader: its class, sampler and device placement stay.

The batches come out of the user's ``__iter__`` (where accelerate moves them to
the device and DDP's sampler shards them); skipping and rollback replay read
through that same iterator and drop what they must, without touching the
training loop's random streams.
"""

from __future__ import annotations

import pytest
import torch
from producers_helpers import Tiny
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from spikeguard.producers import Guard, GuardConfig, GuardedLoader


class OnDevice(tuple):
    """A batch the loader has "moved to the device" (stands in for accelerate's placement)."""

    device = "marker:0"


class PlacingLoader(DataLoader):
    """A DataLoader subclass as accelerate's prepared loaders are: it counts and places batches."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.yielded = 0
        self.epochs_set: list[int] = []

    def __iter__(self):
        for batch in super().__iter__():
            self.yielded += 1
            yield OnDevice(batch)

    def set_epoch(self, epoch: int) -> None:  # accelerate's DataLoaderShard has one
        self.epochs_set.append(epoch)


@pytest.mark.heavy
def test_all_600_batches_go_through_the_users_loader_subclass(tmp_path):
    tiny = Tiny(seed=4)
    sampler = torch.utils.data.RandomSampler(tiny.loader.dataset)
    loader = PlacingLoader(tiny.loader.dataset, batch_size=8, sampler=sampler)
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        run_id="wrap",
        connect=False,
        config=GuardConfig(
            checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=100, resume=False
        ),
    )
    data = guard.data(loader, epochs=20, max_steps=600)
    assert (
        data.loader is loader and type(data.loader) is PlacingLoader and loader.sampler is sampler
    )
    seen = 0
    for batch in data:
        assert isinstance(batch, OnDevice) and batch.device == "marker:0"
        seen += 1
        guard.step(tiny.loss(batch))
    guard.close()
    assert seen == loader.yielded == 600
    assert guard.step_count == 600 and data.dropped == 0
    # 64 batches per epoch: the loader was told each data epoch it entered, in order.
    assert loader.epochs_set == list(range(10))


def _ddp_reference(ds, rank, epochs, seed=3):
    """What a plain DDP loop reads on ``rank``: set_epoch, then the loader, every epoch."""
    sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(ds, batch_size=4, sampler=sampler)
    out = []
    for e in range(epochs):
        sampler.set_epoch(e)
        out += [b.tolist() for (b,) in loader]
    return out


def test_a_distributed_sampler_keeps_its_sharding_and_epoch_shuffling():
    ds = TensorDataset(torch.arange(48))
    got = {}
    for rank in (0, 1):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
        w = GuardedLoader(DataLoader(ds, batch_size=4, sampler=sampler), seed=99, epochs=3)
        got[rank] = [b.tolist() for (b,) in w]
        assert got[rank] == _ddp_reference(ds, rank, 3)  # the sampler's own order, not the guard's
        assert sampler.epoch == 2 and len(w) == 6
    for e in range(3):
        r0, r1 = (sum(got[r][e * 6 : (e + 1) * 6], []) for r in (0, 1))
        assert not set(r0) & set(r1) and sorted(r0 + r1) == list(range(48))  # per-rank shards
    assert got[0][:6] != got[0][6:12]  # a new permutation each epoch


def test_a_rollback_into_an_earlier_epoch_reads_that_epochs_shard_again():
    ds = TensorDataset(torch.arange(48))
    reference = _ddp_reference(ds, 1, 3)
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
    w = GuardedLoader(DataLoader(ds, batch_size=4, sampler=sampler), seed=0, epochs=3)
    seen = []
    for (b,) in w:
        seen.append((w.last_index, b.tolist()))
        if w.last_index == 14 and len(seen) == 15:
            w.seek(4)  # back into epoch 0 from epoch 2
            w.skip(7, 8)
    assert [i for i, _ in seen[15:]] == [4, 5, 6] + list(range(9, 18))
    assert all(batch == reference[i] for i, batch in seen)
    assert w.dropped == 4 + 2  # replayed 0..3 of epoch 0 and read past the skip window 7..8


class NoisyDataset(Dataset):
    """A random augmentation drawn from the global RNG, as many datasets do (num_workers=0)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(float(i)) + torch.rand(())


def test_replaying_to_a_batch_leaves_the_random_streams_as_an_uninterrupted_run_had_them():
    def loader():
        return DataLoader(NoisyDataset(), batch_size=4, shuffle=True)

    torch.manual_seed(11)
    before, batches, after = {}, {}, {}
    w = GuardedLoader(loader(), seed=5, epochs=2)
    it = iter(w)
    for i in range(20):
        before[i] = torch.get_rng_state()
        batches[i] = next(it)
        after[i] = torch.get_rng_state()
        torch.rand(7)  # the training step draws too (dropout, ...)
    for p in (3, 13):  # mid-epoch 0, and mid-epoch 1 (reached by replaying epoch 1's start)
        w = GuardedLoader(loader(), seed=5, epochs=2)
        torch.set_rng_state(before[p])  # what the checkpoint at p restores
        w.seek(p)
        got = next(iter(w))
        assert w.last_index == p and torch.equal(got, batches[p])
        assert torch.equal(torch.get_rng_state(), after[p])  # the dropped batches drew nothing
        assert w.dropped == p % 10


def test_the_guard_keeps_the_users_sampler_object_and_loader_class(tmp_path):
    tiny = Tiny(seed=0)
    sampler = tiny.loader.sampler
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        run_id="keep",
        connect=False,
        config=GuardConfig(checkpoint_every=0, resume=False, checkpoint_dir=str(tmp_path)),
    )
    try:
        data = guard.data(tiny.loader)
        assert data.loader is tiny.loader and tiny.loader.sampler is sampler
        assert len(data) == len(tiny.loader) == 64
    finally:
        guard.close()


def test_an_accelerate_prepared_loader_is_iterated_as_accelerate_iterates_it():
    from accelerate import Accelerator  # the real library (test extra)

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(
        DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True)
    )
    state = accelerator.gradient_state
    w = GuardedLoader(loader, seed=5, epochs=3)
    reference, ends = [], []
    for (b,) in w:
        assert state.active_dataloader is loader  # accelerate's own __iter__ is running
        reference.append(b.tolist())
        ends.append(state.end_of_dataloader)
    assert type(w.loader).__name__ == "DataLoaderShard" and len(reference) == 30
    # accelerate saw each epoch's last batch, and its loop end (gradient accumulation syncs on it)
    assert [i for i, end in enumerate(ends) if end] == [9, 19, 29] and not state.in_dataloader
    assert reference[:10] != reference[10:20]  # its sampler was told the epoch
    replay = GuardedLoader(loader, seed=5, epochs=3)
    replay.seek(13)  # a rollback into epoch 1
    assert [b.tolist() for (b,) in replay] == reference[13:] and replay.dropped == 3
