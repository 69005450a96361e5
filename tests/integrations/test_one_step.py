"""One guarded step: a framework driving ``before_update``/``after_update`` gets what ``Guard.step`` does.

The same model, data, injected trouble and actions run twice: once through
``guard.step(loss)`` and once through a hand-written framework loop that owns
``optimizer.step()``, the GradScaler and ``scheduler.step()`` (as the HF and
Lightning Trainers do) and calls the Guard's two halves around them. Both runs
must publish the same steps (epoch, step, loss, gradient norm, skip reason, LR,
loss scale) and end with the same weights, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from integrations_helpers import acks, action, send, steps
from spikeguard.producers.config import GuardConfig
from spikeguard.producers.external_loop import FrameworkGuard
from spikeguard.producers.guard import Guard
from spikeguard.schemas import AckStatus, ActionKind

STEPS = 64
NAN_STEP = 20  # a non-finite loss: the Guard skips the update at once
OVERFLOW_STEP = 25  # an inf in the scaled gradients: the scaler's own skip (with a scaler only)
SCALE_LR_STEP = 30
OUTLIER_STEP = 45  # an isolated far-out loss: the local outlier rule skips the update
ROLLBACK_STEP, ROLLBACK_TARGET = 56, 50


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    n = 2 * STEPS * 8  # (re-run steps read on: the data never goes back)
    x = torch.randn(n, 6, generator=g)
    y = x @ torch.randn(6, 1, generator=g) + 0.3 * torch.randn(n, 1, generator=g)
    return list(zip(x.split(8), y.split(8)))


def build(framework: bool, tmp_path, bus, amp: bool, mode: str) -> tuple:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.8)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=8) if amp else None
    name = "framework" if framework else "plain"
    config = GuardConfig(
        checkpoint_dir=str(tmp_path / name), resume=False, checkpoint_every=5, mode=mode
    )
    cls = FrameworkGuard if framework else Guard
    guard = cls(model, opt, sched, run_id=name, bus=bus, config=config, scaler=scaler)
    return guard, model, opt, sched, scaler


def run(
    framework: bool, tmp_path, bus, amp: bool = False, mode: str = "protect", spikes: bool = True
) -> Guard:
    """``spikes``: inject the non-finite, overflow and outlier steps (the actions come either way)."""
    guard, model, opt, sched, scaler = build(framework, tmp_path, bus, amp, mode)
    data = iter(batches())
    step = 0
    while step < STEPS:
        xb, yb = next(data)
        if spikes and step == NAN_STEP and guard.generation == 0:
            xb = xb * math.nan
        if spikes and step == OUTLIER_STEP and guard.generation == 0:
            yb = yb * 40.0
        if step == SCALE_LR_STEP and guard.generation == 0:
            send(bus, guard, action(ActionKind.SCALE_LR, step, guard.run_id, factor=0.5))
        if step == ROLLBACK_STEP and guard.generation == 0:
            send(
                bus,
                guard,
                action(ActionKind.ROLLBACK, step, guard.run_id, target_step=ROLLBACK_TARGET),
            )
        if framework:
            guard.batch_read()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if spikes and step == OVERFLOW_STEP and scaler is not None and guard.generation == 0:
            model[0].weight.grad.view(-1)[0] = math.inf
        if not framework:
            guard.step(loss)
            step = guard.step_count
            continue
        guard.before_update(loss, step=step)  # the framework's own step follows, then its scheduler
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        guard.after_update()
        step = guard.step_count  # the framework's counter follows a rollback (as HF's does)
    guard.close()
    return guard


def published(bus, run_id: str) -> list[tuple]:
    return [
        (
            e.epoch,
            e.step,
            round(e.loss, 6) if math.isfinite(e.loss) else "nan",
            None
            if e.grad_norm is None or not math.isfinite(e.grad_norm)
            else round(e.grad_norm, 5),
            e.update_skipped,
            e.skip_reason,
            round(e.lr, 9),
            e.loss_scale,
            e.overflow_streak,
        )
        for e in steps(bus)
        if e.run_id == run_id
    ]


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "grad-scaler"])
@pytest.mark.heavy
def test_the_framework_halves_do_what_guard_step_does(tmp_path, bus, amp):
    plain = run(False, tmp_path, bus, amp)
    framework = run(True, tmp_path, bus, amp)
    mine, theirs = published(bus, "plain"), published(bus, "framework")
    assert mine == theirs
    reasons = {(e[0], e[1]): e[5] for e in mine}
    assert reasons[(0, NAN_STEP)] == "non_finite" and reasons[(0, OUTLIER_STEP)] == "outlier_step"
    if amp:
        assert reasons[(0, OVERFLOW_STEP)] == "scaler_overflow"
        assert {e[7] for e in mine} != {
            None
        }  # the scale is published, and the gradients are unscaled
    assert (1, ROLLBACK_TARGET) in reasons and (0, ROLLBACK_STEP) not in reasons
    for a, b in zip(plain.model.parameters(), framework.model.parameters()):
        assert torch.equal(a, b)
    assert plain.optimizer.param_groups[0]["lr"] == framework.optimizer.param_groups[0]["lr"]
    for name in ("updates", "skipped_updates", "rollbacks", "outlier_skips", "scaler_skips"):
        assert plain.counters[name] == framework.counters[name], name
    by_run = {
        run_id: [(a.kind, a.status) for a in acks(bus) if a.run_id == run_id]
        for run_id in ("plain", "framework")
    }
    assert (
        by_run["plain"]
        == by_run["framework"]
        == [(ActionKind.SCALE_LR, AckStatus.APPLIED), (ActionKind.ROLLBACK, AckStatus.APPLIED)]
    )


def test_observe_mode_keeps_the_update_a_due_rollback_would_have_voided(tmp_path, bus):
    """In observe mode a rollback is only said: the step it was due at trains and is published,
    through the halves as through ``Guard.step``."""
    plain = run(False, tmp_path, bus, mode="observe", spikes=False)
    framework = run(True, tmp_path, bus, mode="observe", spikes=False)
    mine, theirs = published(bus, "plain"), published(bus, "framework")
    assert mine == theirs
    assert [(e[0], e[1]) for e in mine] == [(0, s) for s in range(STEPS)]
    assert not any(e[4] for e in mine)  # nothing skipped: observe mode only says it would
    for a, b in zip(plain.model.parameters(), framework.model.parameters()):
        assert torch.equal(a, b)
    assert framework.summary().withheld == plain.summary().withheld != {}
