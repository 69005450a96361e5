"""Sample provenance (which ids went into each batch) and ranking an incident's samples."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from spikeguard.forensics.provenance import SampleIdTap, StepSamples  # noqa: E402
from spikeguard.forensics.record import IncidentBatches, IncidentFileError  # noqa: E402
from spikeguard.forensics.samples import rank_samples  # noqa: E402


class _Tagged(TensorDataset):
    """Each item carries its own index as its last field, so the test can check the tap."""

    def __getitem__(self, i):
        return (*super().__getitem__(i), torch.tensor(i))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.pipeline
def test_the_tap_gives_each_batch_its_dataset_indices_without_rebuilding_the_loader(workers):
    data = _Tagged(torch.randn(100, 3), torch.randn(100, 1))
    loader = DataLoader(
        data,
        batch_size=8,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
    )
    tap = SampleIdTap(loader)
    assert tap.source == "sampler"
    for _ in range(2):  # two passes: the second reshuffles, the tap follows
        tap.restart()
        for x, _y, idx in loader:
            assert tap.ids(x) == idx.tolist()
    assert len(loader) == 13  # the loader is the user's own, its length unchanged


def test_a_user_id_function_wins_and_an_iterable_without_one_records_nothing():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([{"key": f"doc-{i}", "x": torch.zeros(2)} for i in range(4)])

    loader = DataLoader(Stream(), batch_size=2)
    assert SampleIdTap(loader).source == "none"
    assert SampleIdTap(loader).ids(next(iter(loader))) is None
    tap = SampleIdTap(loader, sample_ids=lambda b: b["key"])
    assert tap.ids(next(iter(loader))) == ["doc-0", "doc-1"]


def test_step_samples_keeps_a_bounded_window():
    log = StepSamples(window=3)
    for step in range(10):
        log.record(step, [step * 10])
    assert log.between(0, 100) == [{"step": s, "ids": [s * 10]} for s in (7, 8, 9)]


def test_three_planted_samples_rank_in_the_top_five():
    torch.manual_seed(0)
    x = torch.randn(320, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [1.5]])
    planted = [17, 140, 301]
    x[17] *= 300  # a corrupted input
    y[140] += 500  # a wrong target
    x[301] *= -150  # another, with its sign flipped
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    items = [(i, i // 32, (x[i], y[i])) for i in range(320)]

    def collate(batch):
        return torch.stack([a for a, _ in batch]), torch.stack([b for _, b in batch])

    def loss_fn(m, batch):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(m(inputs), targets, reduction="none").mean(dim=1)

    ranked = rank_samples(model, items, collate, loss_fn)
    assert set(planted) <= {s.sample_id for s in ranked[:5]}
    assert ranked[0].score > 6 and ranked[10].score < 6
    assert all(p.grad is None for p in model.parameters())


def _regression(n: int, planted: list[int]):
    torch.manual_seed(0)
    x = torch.randn(n, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [1.5]])
    for i in planted:
        y[i] += 500  # a wrong target
    items = [(i, i // 32, (x[i], y[i])) for i in range(n)]

    def collate(batch):
        return torch.stack([a for a, _ in batch]), torch.stack([b for _, b in batch])

    def loss_fn(m, batch):
        inputs, targets = batch
        return torch.nn.functional.mse_loss(m(inputs), targets, reduction="none").mean(dim=1)

    return items, collate, loss_fn


def test_the_ranking_is_batched_and_gives_each_samples_own_loss_and_gradient_norm():
    """1,000 samples in a few forward passes (per-sample gradients in one pass per chunk), with
    the loss and gradient norm each sample has alone in a batch of one."""
    items, collate, loss_fn = _regression(1000, planted=[5, 500, 999])
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    ranked = rank_samples(model, items, collate, loss_fn)
    assert len(calls) <= 10
    assert {s.sample_id for s in ranked[:3]} == {5, 500, 999}
    by_id = {s.sample_id: s for s in ranked}
    for sid in (0, 5, 123, 999):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, collate([items[sid][2]])).sum()
        loss.backward()
        norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert by_id[sid].loss == pytest.approx(loss.item(), rel=1e-4)
        assert by_id[sid].grad_norm == pytest.approx(norm.item(), rel=1e-4)
    model.zero_grad(set_to_none=True)


def test_a_model_vmap_cannot_run_is_ranked_one_sample_at_a_time():
    """A collate that yields a non-tensor field cannot go through vmap: same ranking, slower."""
    items, collate, loss_fn = _regression(64, planted=[7])

    def collate_with_names(batch):
        return (*collate(batch), [f"s{i}" for i in range(len(batch))])

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ranked = rank_samples(model, items, collate_with_names, lambda m, b: loss_fn(m, b[:2]))
    assert ranked[0].sample_id == 7
    assert all(p.grad is None for p in model.parameters())


def test_an_incident_file_round_trips_and_a_bad_one_is_named(tmp_path):
    incident = IncidentBatches(
        "run", "inc-1", 120, 0, str(tmp_path / "ck.pt"), 100, [{"step": 119, "ids": [1, 2]}]
    )
    assert IncidentBatches.read(incident.write(tmp_path / "i.json")) == incident
    (tmp_path / "bad.json").write_text('{"run_id": 1}')
    with pytest.raises(IncidentFileError, match="bad.json: not a spikeguard incident file"):
        IncidentBatches.read(tmp_path / "bad.json")
    with pytest.raises(IncidentFileError, match="no such incident file"):
        IncidentBatches.read(tmp_path / "missing.json")


def test_a_batch_sampler_of_its_own_records_nothing_rather_than_wrong_ids():
    class Buckets(torch.utils.data.Sampler):
        def __init__(self):
            self.sampler = range(10)  # looks like a BatchSampler, draws otherwise

        def __iter__(self):
            return iter([[9, 0], [5, 4]])

        def __len__(self):
            return 2

    loader = DataLoader(TensorDataset(torch.arange(10)), batch_sampler=Buckets())
    tap = SampleIdTap(loader)
    assert tap.source == "none" and tap.ids(next(iter(loader))[0]) is None


def test_inspect_finds_the_setup_module_in_the_current_directory(tmp_path, monkeypatch):
    """As the console script runs it: the current directory is not on sys.path."""
    import sys

    from spikeguard.forensics.inspect import InspectSetup, load_setup

    (tmp_path / "sg_user_setup_mod.py").write_text(
        "import torch\n"
        "from spikeguard import InspectSetup\n"
        "def make():\n"
        "    return InspectSetup(torch.nn.Linear(2, 1), [torch.zeros(2)], torch.stack,\n"
        "                        lambda m, b: m(b).squeeze(1))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert isinstance(load_setup("sg_user_setup_mod:make"), InspectSetup)
    assert str(tmp_path) not in sys.path  # borrowed for the import only
