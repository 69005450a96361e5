"""Forensics in a real guarded run: the samples behind an incident, and re-running a suspicious step."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from forensics_helpers import lockstep_guard  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

PLANTED = [
    100 * 32 + 5,
    100 * 32 + 17,
    100 * 32 + 29,
]  # one bad stretch of data: the batch of step 100


def _problem(seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(8192, 8)
    y = x @ torch.randn(8, 1) + 0.05 * torch.randn(8192, 1)
    x[PLANTED] *= 400  # three corrupted samples
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    return model, TensorDataset(x, y)


def _collate(items):
    return torch.stack([a for a, _ in items]), torch.stack([b for _, b in items])


def _per_sample_loss(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets, reduction="none").mean(dim=1)


def _guarded_run(tmp_path, model, dataset, steps, config_extra=None, fault=None, skip_ids=None):
    from spikeguard.demo.run import DEMO_SETTINGS
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    runtime = open_runtime(load_settings(DEMO_SETTINGS, env={}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    loader = DataLoader(dataset, batch_size=32, shuffle=False)  # the user's loader, as is
    guard = lockstep_guard(runtime, model, optimizer, tmp_path, "forensics", **(config_extra or {}))
    try:
        for xb, yb in guard.data(loader, max_steps=steps, skip_ids=skip_ids):

            def closure(xb=xb, yb=yb):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                loss.backward()
                return loss

            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(fault(guard, xb) if fault else xb), yb)
            loss.backward()
            guard.step(loss, closure=closure)
    finally:
        guard.close()
        runtime.close()
    return guard


def test_the_three_planted_samples_come_out_in_the_top_five(tmp_path):
    from spikeguard.forensics.inspect import InspectSetup, inspect_incident
    from spikeguard.forensics.record import IncidentBatches

    model, dataset = _problem()
    # The local skip rule would take these updates out at once (no incident to inspect): the
    # pipeline handles them here, as it does a spike the rule cannot see.
    guard = _guarded_run(tmp_path, model, dataset, steps=140, config_extra={"skip_outliers": False})
    assert guard.counters["rollbacks"] >= 1
    incidents = [IncidentBatches.read(f) for f in (tmp_path / "ck" / "incidents").glob("*.json")]
    incident = next(i for i in incidents if any(b["step"] == 100 for b in i.batches))
    assert incident.checkpoint_step is not None and incident.checkpoint_step < incident.onset_step
    recorded = {sid for b in incident.batches for sid in b["ids"]}
    assert set(PLANTED) <= recorded  # the window's ids are the dataset's indices

    fresh, _ = _problem(seed=1)  # weights come from the incident's checkpoint, not from here
    report = inspect_incident(
        incident, InspectSetup(fresh, dataset, _collate, _per_sample_loss), tmp_path / "out"
    )
    top5 = [row["sample_id"] for row in report["top"][:5]]
    assert set(PLANTED) <= set(top5), top5
    assert set(PLANTED) <= set(report["skip_ids"])
    written = json.loads(next((tmp_path / "out").glob("inspect-*.json")).read_text())
    assert written["top"][0]["sample_id"] in PLANTED
    assert "<table" in next((tmp_path / "out").glob("inspect-*.html")).read_text()

    # The loop closed: the same run again, given inspect's report, never reads those samples
    # and has nothing to recover from.
    class Watched(TensorDataset):
        read: set[int] = set()

        def __getitem__(self, index):
            self.read.add(int(index))
            return super().__getitem__(index)

    model, dataset = _problem()
    again = _guarded_run(
        tmp_path / "again",
        model,
        Watched(*dataset.tensors),
        steps=140,
        config_extra={"skip_outliers": False},
        skip_ids=next((tmp_path / "out").glob("inspect-*.json")),
    )
    assert Watched.read and not set(PLANTED) & Watched.read
    assert again.counters["rollbacks"] == 0


def _clean():
    model, dataset = _problem()
    x = dataset.tensors[0].clone()
    x[PLANTED] /= 400
    return model, TensorDataset(x, dataset.tensors[1])


def test_a_fault_on_the_first_run_only_is_transient_applies_the_rerun_and_costs_no_rollback(
    tmp_path,
):
    model, dataset = _clean()
    flaky_step = 90

    def fault(guard, xb):  # the device flips bits once; the closure re-reads the batch clean
        return xb * float("nan") if guard.step_count == flaky_step and guard.generation == 0 else xb

    guard = _guarded_run(
        tmp_path, model, dataset, steps=110, config_extra={"verify_reruns": 1}, fault=fault
    )
    assert guard.rerun.counts == {"transient": 1, "reproducible": 0}
    # the clean re-run's update is the step's true one: applied, nothing skipped
    assert guard.counters["transient_steps"] == 1 and guard.counters["skipped_updates"] == 0
    assert guard.counters["updates"] == 110
    assert guard.counters["rollbacks"] == 0 and guard.generation == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_poisoned_batch_is_reproducible_and_the_usual_policy_applies(tmp_path):
    model, dataset = _clean()
    dataset.tensors[0][60 * 32 + 3] = float("nan")  # in the data: every run of it is NaN
    guard = _guarded_run(tmp_path, model, dataset, steps=110, config_extra={"verify_reruns": 1})
    assert guard.rerun.counts["reproducible"] >= 1 and guard.rerun.counts["transient"] == 0
    assert guard.counters["transient_steps"] == 0
    # The Guard skipped the NaN update itself; the policy says so and adds nothing unless it
    # recurs (it does not within these 110 steps): no rollback, no skipped data.
    assert guard.counters["rollbacks"] == 0 and guard.counters["skipped_batches"] == 0
    assert any(a["kind"] == "alert" for a in guard.applied)
