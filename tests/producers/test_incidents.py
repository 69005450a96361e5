"""The Guard's incident record: the window's sample ids and a checkpoint that outlives rotation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from spikeguard.forensics.record import IncidentBatches  # noqa: E402
from spikeguard.producers.incidents import IncidentRecorder  # noqa: E402


def test_an_incident_file_holds_the_window_ids_and_a_linked_checkpoint(tmp_path):
    data = TensorDataset(torch.arange(40).float().unsqueeze(1))
    loader = DataLoader(
        data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)
    )
    recorder = IncidentRecorder(tmp_path, "run", lookback=2)
    recorder.attach(loader)
    recorder.restart()
    seen = {}
    for step, (x,) in enumerate(loader):
        recorder.batch(x)
        recorder.step(step)
        seen[step] = x.squeeze(1).long().tolist()  # the values are the indices
    checkpoint = tmp_path / "ck-3.pt"
    torch.save({"model": {}}, checkpoint)
    infos = {3: SimpleNamespace(step=3, path=checkpoint)}
    path = recorder.incident(
        "inc",
        onset_step=6,
        epoch=0,
        now_step=7,
        checkpoint=lambda max_step: infos[3] if max_step >= 3 else None,
    )
    record = IncidentBatches.read(path)
    assert [b["step"] for b in record.batches] == [4, 5, 6, 7]
    assert all(b["ids"] == seen[b["step"]] for b in record.batches)
    assert record.checkpoint_step == 3
    checkpoint.unlink()  # rotation deletes the original; the incident's copy stays
    assert torch.load(record.checkpoint, weights_only=True) == {"model": {}}
    # Once per incident.
    assert recorder.incident("inc", 6, 0, 9, checkpoint=lambda s: None) is None
