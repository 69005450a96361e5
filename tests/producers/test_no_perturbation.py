"""A run the Guard never acts on is the user's run to the bit: same data order, same random draws."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from spikeguard.producers import Guard, GuardConfig, GuardedLoader

EPOCHS = 4


class Jittered(Dataset):
    """Draws from the global RNG as it is read (an augmentation inside the dataset)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(96, 6, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i] + 0.01 * torch.rand(6), self.y[i]


def _problem(loader_generator: bool = False, **loader_options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(3) if loader_generator else None
    loader = DataLoader(
        Jittered(), batch_size=8, shuffle=True, generator=generator, **loader_options
    )
    return model, optimizer, loader


def _loss(model, optimizer, batch) -> torch.Tensor:
    x, y = batch
    x = x + 0.05 * torch.rand_like(x)  # an augmentation in the loop
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


def _unguarded(loader_generator: bool = False, **loader_options) -> list[torch.Tensor]:
    model, optimizer, loader = _problem(loader_generator, **loader_options)
    for _ in range(EPOCHS):
        for batch in loader:
            _loss(model, optimizer, batch)
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _guarded(
    tmp_path, loader_generator: bool = False, loader_options=None, **options
) -> tuple[list, Guard]:
    model, optimizer, loader = _problem(loader_generator, **(loader_options or {}))
    config = GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=10, resume="never")
    guard = Guard(model, optimizer, run_id="same", config=config, **options)
    for batch in guard.data(loader, epochs=EPOCHS):
        guard.step(_loss(model, optimizer, batch))
    guard.close()
    return [p.detach().clone() for p in model.parameters()], guard


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    worst = max((x - y).abs().max().item() for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(a, b)), f"weights differ (max |diff| {worst:.3g})"


@pytest.mark.parametrize("mode", ["protect", "observe"])
def test_a_guarded_run_without_actions_is_the_unguarded_run(tmp_path, mode):
    weights, guard = _guarded(tmp_path, connect=False, mode=mode)
    assert guard.counters["updates"] == EPOCHS * 12
    _assert_same(weights, _unguarded())


def test_the_same_with_a_generator_of_the_users_own(tmp_path):
    weights, _ = _guarded(tmp_path, loader_generator=True, connect=False)
    _assert_same(weights, _unguarded(loader_generator=True))


@pytest.mark.heavy
@pytest.mark.parametrize("persistent", [False, True])
def test_the_same_with_worker_processes(tmp_path, persistent):
    """Workers draw their augmentation from seeds made of the base seed; persistent workers
    draw that base seed once, at the loader's first iter()."""
    options = dict(num_workers=1, persistent_workers=persistent)
    weights, _ = _guarded(tmp_path, loader_options=options, connect=False)
    _assert_same(weights, _unguarded(**options))


@pytest.mark.heavy
def test_the_same_with_the_default_embedded_pipeline(tmp_path):
    weights, guard = _guarded(tmp_path)
    assert guard.counters["rollbacks"] == guard.counters["skipped_updates"] == 0
    _assert_same(weights, _unguarded())


def test_an_epoch_entered_again_is_read_in_the_order_it_was_first_read():
    torch.manual_seed(9)
    loader = DataLoader(Jittered(), batch_size=8, shuffle=True)  # 12 batches per epoch
    data = GuardedLoader(loader, epochs=3)
    first = {}
    for x, _ in data:
        first[data.last_index] = x
    for start in (5, 12, 20):  # mid-epoch (the streams hold the draws) and an epoch's start
        torch.manual_seed(100 + start)  # whatever the global RNG says now, the order is kept
        data.seek(start)
        again = GuardedLoader.__iter__(data)
        x, _ = next(again)
        assert data.last_index == start
        assert torch.allclose(x, first[start], atol=0.011)  # the same samples (fresh jitter)
    restored = GuardedLoader(loader, epochs=3)
    restored.load_state_dict(data.state_dict())  # a resume: the record travels in checkpoints
    restored.seek(20)
    x, _ = next(iter(restored))
    assert torch.allclose(x, first[20], atol=0.011)
