"""The Guard in a plain loop: statistics, one transfer, non-finite skip, events, checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
from producers_helpers import Tiny, make_guard, train

from spikeguard.producers import GradStats
from spikeguard.schemas import CheckpointEvent, StepEvent, decode


def _steps(bus, topics) -> list[StepEvent]:
    return [decode(r.value, StepEvent) for r in bus.read_all(topics.steps)]


def test_publishes_one_event_per_step_with_statistics(bus, topics, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    train(guard, tiny, 12)
    guard.close()
    events = _steps(bus, topics)
    assert [e.step for e in events] == list(range(12))
    first = events[0]
    assert first.run_id == "r1" and first.epoch == 0 and math.isfinite(first.loss)
    assert first.grad_norm and first.grad_norm > 0
    assert first.lr == 1e-2 and not first.update_skipped
    assert set(first.top_grad_norms) <= {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert len(first.top_grad_norms) == 4
    assert [e.batch_index for e in events] == list(range(12))
    # the total norm is the norm of the per-parameter norms, as clip_grad_norm_ computes it
    assert max(first.top_grad_norms.values()) <= first.grad_norm


def test_grad_norm_matches_torch_clip_grad_norm():
    tiny = Tiny()
    loss = tiny.loss(next(iter(tiny.loader)))
    stats, _ = GradStats(list(tiny.model.named_parameters()), top_k=2).compute(loss)
    expected = torch.nn.utils.clip_grad_norm_(tiny.model.parameters(), float("inf"))
    assert abs(stats.grad_norm - float(expected)) < 1e-5
    assert abs(stats.loss - float(loss.detach())) < 1e-6
    assert len(stats.top_grad_norms) == 2 and stats.nonfinite_grads == 0


def test_one_device_to_host_transfer_per_step(monkeypatch):
    tiny = Tiny()
    stats = GradStats(list(tiny.model.named_parameters()), top_k=3, param_norm=True)
    loss = tiny.loss(next(iter(tiny.loader)))
    batch = next(iter(tiny.loader))
    calls = {"item": 0, "tolist": 0, "cpu": 0}
    for name in calls:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _orig=original, **k):
            calls[_name] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    stats.compute(loss, batch=batch)
    assert calls == {"item": 0, "tolist": 1, "cpu": 0}


def test_nonfinite_loss_skips_the_update_at_once(bus, topics, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    data = guard.data(tiny.loader)
    it = iter(data)
    guard.step(tiny.loss(next(it)))
    before = tiny.params()
    x, y = next(it)
    x = x.clone()
    x[0, 0] = float("nan")
    applied = guard.step(tiny.loss((x, y)))
    assert applied is False
    assert all(torch.equal(a, b) for a, b in zip(before, tiny.params()))
    assert guard.counters["skipped_updates"] == 1
    guard.step(tiny.loss(next(it)))  # and training goes on
    assert not all(torch.equal(a, b) for a, b in zip(before, tiny.params()))
    guard.close()
    events = _steps(bus, topics)
    assert events[1].update_skipped and not math.isfinite(events[1].loss)
    assert events[1].nonfinite_grads > 0
    assert not events[2].update_skipped


def test_checkpoints_periodic_and_unhealthy_after_nonfinite(bus, topics, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=5, incident_window=3)

    def poison(g, data, batch):
        if g.step_count == 9:
            batch[0][:] = float("inf")

    train(guard, tiny, 21, on_step=poison)
    guard.close()
    events = [decode(r.value, CheckpointEvent) for r in bus.read_all(topics.checkpoints)]
    events = [e for e in events if not e.deleted]  # rotation announcements aside
    assert [(e.step, e.healthy) for e in events] == [
        (0, True),
        (5, True),
        (10, False),
        (15, True),
        (20, True),
    ]
    assert all(e.reason == "periodic" and e.epoch == 0 for e in events)
    assert events[1].batch_index == 5


def test_optional_batch_statistics(bus, topics, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    for i, batch in enumerate(guard.data(tiny.loader)):
        x, y = batch
        guard.step(tiny.loss(batch), batch=(x, (y > 0).long().reshape(-1)))
        if i == 2:
            break
    guard.close()
    stats = _steps(bus, topics)[0].batch
    assert stats is not None and stats.size == 8 and stats.nan_inputs == 0
    assert 0.5 <= stats.max_label_fraction <= 1.0


@pytest.mark.pipeline
def test_works_without_a_bus(tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, None, tmp_path, checkpoint_every=0)
    guard.connect = False
    train(guard, tiny, 5)
    guard.close()
    assert guard.step_count == 5 and guard.counters["updates"] == 5
