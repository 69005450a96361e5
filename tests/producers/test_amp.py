"""Mixed precision: the Guard with torch.amp.GradScaler, and with bf16 autocast alone.

Overflows are injected the way fp16 produces them: an infinite element in a
scaled gradient after ``scaler.scale(loss).backward()``. The scaler skips that
update and halves its scale; that is normal and must stay quiet.
"""

from __future__ import annotations

import math

import torch
from producers_helpers import Tiny, make_guard

from spikeguard.producers import Guard, GuardConfig, GuardedLoader
from spikeguard.schemas import Decision, StepEvent, decode

STEPS = 150
OVERFLOWS = {30, 60, 61, 90}
NOISE = 0.5  # a loss that levels off at its noise, not at ~0 where any batch is a x40 "spike"


def _overflow(model: torch.nn.Module) -> None:
    next(model.parameters()).grad.view(-1)[0] = float("inf")


def _eval_loss(tiny: Tiny) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(tiny.model(tiny.x), tiny.y))


def _scaled_loss(tiny: Tiny, scaler, x, y) -> torch.Tensor:
    tiny.optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(tiny.model(x), y)
    scaler.scale(loss).backward()
    return loss


def _unguarded(seed: int) -> float:
    tiny = Tiny(seed=seed, noise=NOISE)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    loader = GuardedLoader(tiny.loader, seed=seed, epochs=10)  # the guard's data order
    for step, (x, y) in zip(range(STEPS), loader):
        _scaled_loss(tiny, scaler, x, y)
        if step in OVERFLOWS:
            _overflow(tiny.model)
        scaler.step(tiny.optimizer)
        scaler.update()
    return _eval_loss(tiny)


def test_fp16_overflow_skips_are_normal_steps_under_the_full_pipeline(tmp_path):
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    unguarded = _unguarded(seed=3)
    tiny = Tiny(seed=3, noise=NOISE)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    runtime = open_runtime(load_settings({}, env={}))
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        run_id="amp",
        runtime=runtime,
        scaler=scaler,
        config=GuardConfig(
            checkpoint_dir=str(tmp_path / "ckpt"), resume=False, lockstep=True, data_seed=3
        ),
    )
    try:
        data = guard.data(tiny.loader, epochs=10, max_steps=STEPS)
        for x, y in data:
            loss = _scaled_loss(tiny, scaler, x, y)
            if guard.step_count in OVERFLOWS:
                _overflow(tiny.model)
            guard.step(loss)  # the first overflow crashed here: "No inf checks were recorded"
    finally:
        guard.close()
        events = [decode(r.value, StepEvent) for r in runtime.bus.read_all(runtime.topics.steps)]
        decisions = [
            decode(r.value, Decision) for r in runtime.bus.read_all(runtime.topics.decisions)
        ]
        runtime.close()
    guarded = _eval_loss(tiny)
    print(f"AMP final eval loss: guarded {guarded:.5f} unguarded {unguarded:.5f}")
    assert guard.step_count == STEPS, (guard.stop_reason, list(guard.applied), guard.counters)
    assert abs(guarded - unguarded) <= 0.05 * unguarded
    assert guard.counters["rollbacks"] == 0 and guard.counters["skipped_updates"] == 0
    assert guard.counters["scaler_skips"] == len(OVERFLOWS)
    assert [a for a in guard.applied if a["status"] == "applied"] == []  # no action at all
    assert not [d for d in decisions if d.is_anomaly]
    assert {e.lr for e in events} == {1e-2} and guard.lr.scale == 1.0  # LR unchanged
    by_step = {e.step: e for e in events}
    for s in OVERFLOWS:
        e = by_step[s]
        assert e.update_skipped and e.skip_reason == "scaler_overflow" and e.grad_norm is None
    assert by_step[61].overflow_streak == 2 and by_step[62].overflow_streak == 0
    assert by_step[61].loss_scale == by_step[60].loss_scale / 2  # the scaler backed off
    # statistics of the unscaled gradients (the scaled norm was ~65,536 times larger)
    reference = Tiny(seed=3, noise=NOISE)
    x, y = next(iter(GuardedLoader(reference.loader, seed=3)))
    torch.nn.functional.mse_loss(reference.model(x), y).backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in reference.model.parameters()]))
    assert math.isclose(by_step[0].grad_norm, expected, rel_tol=1e-4)


def test_a_run_of_overflow_skips_that_keeps_lowering_the_scale_is_reported(bus, topics, tmp_path):
    tiny = Tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        run_id="r1",
        bus=bus,
        scaler=scaler,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False),
    )
    before = None
    for x, y in guard.data(tiny.loader, max_steps=25):
        loss = _scaled_loss(tiny, scaler, x, y)
        if 10 <= guard.step_count < 20:
            _overflow(tiny.model)
            before = before or [p.detach().clone() for p in tiny.model.parameters()]
        guard.step(loss)
        if guard.step_count == 20:  # ten overflow skips: no update at all
            assert all(torch.equal(a, b) for a, b in zip(before, tiny.model.parameters()))
    guard.close()
    events = {e.step: e for e in (decode(r.value, StepEvent) for r in bus.read_all(topics.steps))}
    assert [events[s].overflow_streak for s in range(9, 21)] == [0, *range(1, 11), 0]
    assert [events[s].loss_scale for s in (10, 15, 20)] == [2.0**16, 2.0**11, 2.0**6]
    assert scaler.get_scale() == 2.0**6
    assert guard.counters["scaler_skips"] == 10 and guard.counters["updates"] == 15


def test_the_users_own_unscale_for_clipping_is_respected(bus, tmp_path):
    tiny = Tiny()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        run_id="r1",
        bus=bus,
        scaler=scaler,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False),
    )
    for x, y in guard.data(tiny.loader, max_steps=5):
        loss = _scaled_loss(tiny, scaler, x, y)
        scaler.unscale_(tiny.optimizer)
        torch.nn.utils.clip_grad_norm_(tiny.model.parameters(), 1.0)
        guard.step(loss)
    guard.close()
    assert guard.counters["updates"] == 5 and scaler.get_scale() == 2.0**10


def test_bf16_autocast_without_a_scaler(bus, topics, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    before = [p.detach().clone() for p in tiny.model.parameters()]
    for x, y in guard.data(tiny.loader, max_steps=6):
        tiny.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(tiny.model(x), y)
        assert loss.dtype == torch.float32 or loss.dtype == torch.bfloat16
        loss.backward()
        assert guard.step(loss)
    guard.close()
    events = [decode(r.value, StepEvent) for r in bus.read_all(topics.steps)]
    assert len(events) == 6 and all(
        math.isfinite(e.grad_norm) and e.loss_scale is None for e in events
    )
    assert not any(e.update_skipped for e in events)
    assert not all(torch.equal(a, b) for a, b in zip(before, tiny.model.parameters()))
