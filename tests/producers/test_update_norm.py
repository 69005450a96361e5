"""The Guard's update_norm and param_norm: what a direct computation gives, 0 for a skipped update.

The event of step s carries the update made at step s-1 (it rides along with
step s's one transfer) and the parameter norm at step s, before its update.
"""

from __future__ import annotations

import math

import torch
from producers_helpers import Tiny, make_guard

from spikeguard.schemas import StepEvent, decode

STEPS = 30


def _steps(bus, topics) -> list[StepEvent]:
    return [decode(r.value, StepEvent) for r in bus.read_all(topics.steps)]


def _total_norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def test_events_carry_the_update_and_parameter_norms_of_a_direct_computation(bus, topics, tmp_path):
    tiny = Tiny(seed=1)  # Adam: the update is not lr * grad, it is measured
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=0, update_norm=True, param_norm=True)
    expected_update, expected_param = {}, {}
    batches = iter(guard.data(tiny.loader))
    for step in range(STEPS):
        loss = tiny.loss(next(batches))
        before = tiny.params()
        expected_param[step] = _total_norm(before)
        assert guard.step(loss)
        expected_update[step] = _total_norm([b - a for a, b in zip(tiny.params(), before)])
    guard.close()
    events = _steps(bus, topics)
    assert [e.step for e in events] == list(range(STEPS))
    assert events[0].update_norm is None  # no update before the first step
    for e in events:
        assert e.param_norm is not None and math.isclose(
            e.param_norm, expected_param[e.step], rel_tol=1e-5
        )
        if e.step:
            assert e.update_norm is not None and e.update_norm > 0
            assert math.isclose(e.update_norm, expected_update[e.step - 1], rel_tol=1e-4), e.step


def test_a_skipped_update_is_zero_and_a_rollback_starts_without_one(bus, topics, tmp_path):
    tiny = Tiny(seed=2)
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=5, update_norm=True)
    batches = iter(guard.data(tiny.loader))
    for _ in range(8):
        guard.step(tiny.loss(next(batches)))
    x, y = next(batches)
    x = x.clone()
    x[0, 0] = float("nan")
    assert guard.step(tiny.loss((x, y))) is False  # step 8: a non-finite loss, update skipped
    guard.step(tiny.loss(next(batches)))  # step 9
    guard.rollback(5)
    guard.step(tiny.loss(next(batches)))  # step 5 again, in epoch 1
    guard.step(tiny.loss(next(batches)))
    guard.close()
    by_key = {(e.epoch, e.step): e for e in _steps(bus, topics)}
    assert by_key[(0, 9)].update_norm == 0.0
    assert by_key[(0, 8)].update_norm > 0
    assert by_key[(1, 5)].update_norm is None  # the parameters came from a checkpoint
    assert by_key[(1, 6)].update_norm > 0


def test_a_scaler_overflow_skip_is_an_update_of_zero(bus, topics, tmp_path):
    tiny = Tiny(seed=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=0, update_norm=True)
    guard.scaler = scaler
    guard.amp.scaler = scaler
    batches = iter(guard.data(tiny.loader))
    for step in range(6):
        x, y = next(batches)
        tiny.optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(tiny.model(x), y)
        scaler.scale(loss).backward()
        if step == 3:
            next(tiny.model.parameters()).grad.view(-1)[0] = float("inf")
        guard.step(loss)
    guard.close()
    events = {e.step: e for e in _steps(bus, topics)}
    assert events[3].skip_reason == "scaler_overflow"
    assert events[4].update_norm == 0.0
    assert events[3].update_norm > 0 and events[5].update_norm > 0


def test_by_default_it_reports_nothing(bus, topics, tmp_path):
    tiny = Tiny(seed=4)
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=0)
    batches = iter(guard.data(tiny.loader))
    for _ in range(4):
        guard.step(tiny.loss(next(batches)))
    guard.close()
    assert all(e.update_norm is None and e.param_norm is None for e in _steps(bus, topics))
