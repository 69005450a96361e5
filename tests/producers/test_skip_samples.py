"""guard.data(loader, skip_ids=...): the samples inspect named never reach a batch."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from spikeguard.producers.skip_samples import SkipIdsError, leave_out  # noqa: E402


def _loader(shuffle: bool) -> DataLoader:
    data = TensorDataset(torch.arange(100))
    return DataLoader(
        data, batch_size=8, shuffle=shuffle, generator=torch.Generator().manual_seed(0)
    )


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_inspect_reports_skip_ids_never_reach_a_batch(tmp_path, shuffle):
    report = tmp_path / "inspect-run-i1.json"
    report.write_text(json.dumps({"top": [], "skip_ids": [3, 50, 97, 1000]}))
    loader = _loader(shuffle)
    assert leave_out(loader, report) == 3  # 1000 is not in this dataset
    seen = [int(i) for (batch,) in loader for i in batch]
    assert sorted(seen) == [i for i in range(100) if i not in (3, 50, 97)]
    assert len(loader) == 13 and all(len(b) == 8 for (b,) in list(loader)[:-1])  # sizes kept


def test_a_bad_skip_list_or_a_loader_it_cannot_apply_to_is_named(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps({"top": []}))
    with pytest.raises(SkipIdsError, match="other.json: expected spikeguard inspect's report"):
        leave_out(_loader(False), tmp_path / "other.json")
    with pytest.raises(SkipIdsError, match="nope.json: no such file"):
        leave_out(_loader(False), tmp_path / "nope.json")
    weighted = DataLoader(
        TensorDataset(torch.arange(10)),
        batch_size=2,
        sampler=torch.utils.data.WeightedRandomSampler([1.0] * 10, 10),
    )
    with pytest.raises(SkipIdsError, match="WeightedRandomSampler"):
        leave_out(weighted, [1])
