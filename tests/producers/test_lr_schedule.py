"""The LR belongs to the user's scheduler: the guard's factor composes with it, restore removes it."""

from __future__ import annotations

import math

import pytest
import torch
from producers_helpers import Tiny, action, send

from spikeguard.producers import Guard, GuardConfig
from spikeguard.schemas import ActionKind, StepEvent, decode

K = ActionKind
STEPS = 40


def _warmup_cosine(optimizer: torch.optim.Optimizer):
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.05, total_iters=10)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS - 10, eta_min=1e-4)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[10])


def _schedule() -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    sched = _warmup_cosine(opt)
    lrs = []
    for _ in range(STEPS):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("owner", ["guard", "user"])
def test_scale_composes_with_warmup_and_cosine_and_restore_gives_the_schedule_back(
    owner, bus, topics, tmp_path
):
    """``owner="user"``: the loop steps its scheduler itself and the Guard never sees it; the
    LR the Guard found at start was then the warm-up's first value (5 % of the schedule), and
    restoring "towards base" stuck the LR there."""
    tiny = Tiny()
    sched = _warmup_cosine(tiny.optimizer)
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        sched if owner == "guard" else None,
        run_id="r1",
        bus=bus,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False),
    )
    send(
        bus,
        action(K.SCALE_LR, 4, factor=0.25),
        action(K.RESTORE_LR, 8, factor=2.0),
        action(K.RESTORE_LR, 14, factor=2.0),
        action(K.SCALE_LR, 25, factor=0.5),
        action(K.RESTORE_LR, 30, factor=4.0),
        guard=guard,
    )
    scheduled = []
    for x, y in guard.data(tiny.loader, max_steps=STEPS):
        scheduled.append(tiny.optimizer.param_groups[0]["lr"])
        guard.step(tiny.loss((x, y)))
        if owner == "user":
            sched.step()
    guard.close()
    guard.publisher.flush(5.0)
    expected = _schedule()
    assert scheduled == pytest.approx(expected)  # the schedule itself is never overwritten
    lr = {e.step: e.lr for e in (decode(r.value, StepEvent) for r in bus.read_all(topics.steps))}
    factor = {
        **{s: 0.25 for s in range(4, 8)},
        **{s: 0.5 for s in range(8, 14)},
        **{s: 0.5 for s in range(25, 30)},
    }
    for step in range(STEPS):
        assert math.isclose(lr[step], expected[step] * factor.get(step, 1.0), rel_tol=1e-9), step
    assert guard.lr.scale == 1.0
