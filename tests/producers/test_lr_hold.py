"""A jump of the schedule that damaged the run is held at the rate the run trained at, and the
schedule is given back exactly when it comes down (issue 38: runs ended at 0.12-0.24x their
schedule when the answer was a factor restored x1.25 per 200 steps)."""

from __future__ import annotations

import pytest
import torch

from spikeguard.producers.lr import LRControl


def _loop(lambda_: object) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda_)  # type: ignore[arg-type]


def _train(lr: LRControl, optimizer, scheduler, steps: int) -> list[float]:
    """The LR each update was applied at."""
    applied = []
    for _ in range(steps):
        optimizer.zero_grad()
        optimizer.param_groups[0]["params"][0].sum().backward()
        lr.step(lambda: applied.append(optimizer.param_groups[0]["lr"]) or optimizer.step())
        scheduler.step()
    return applied


def _blowup(step: int) -> float:
    return 50.0 if 20 <= step < 30 else 1.0


def test_a_held_jump_stays_at_the_peak_and_the_schedule_comes_back_exactly() -> None:
    optimizer, scheduler = _loop(_blowup)
    lr = LRControl(optimizer)
    before = _train(lr, optimizer, scheduler, 10)
    saved = lr.state_dict()  # a checkpoint before the jump
    lr.load_state_dict(saved)  # (the rollback restores it) ...
    assert "0.1" in lr.hold()  # ... and the HOLD_LR sent with it arms the hold
    after = _train(lr, optimizer, scheduler, 40)
    assert before == pytest.approx([0.1] * 10)
    assert after == pytest.approx([0.1] * 40)  # the x50 window of steps 20-29 held at 0.1
    assert lr.scale == 1.0 and not lr.holding
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1)  # the schedule untouched


def test_without_the_hold_the_jump_goes_through() -> None:
    optimizer, scheduler = _loop(_blowup)
    lr = LRControl(optimizer)
    applied = _train(lr, optimizer, scheduler, 40)
    assert applied[20:30] == pytest.approx([5.0] * 10)


def test_a_warm_up_and_a_guard_factor_are_not_held() -> None:
    """A warm-up rises slower than a jump; a scale the policy set stays its own."""
    optimizer, scheduler = _loop(lambda step: min(1.0, (step + 1) / 20))
    lr = LRControl(optimizer)
    _train(lr, optimizer, scheduler, 5)
    lr.hold()
    applied = _train(lr, optimizer, scheduler, 30)
    assert applied == pytest.approx([0.1 * min(1.0, (s + 1) / 20) for s in range(5, 35)])
    lr.scale_by(0.5)
    assert _train(lr, optimizer, scheduler, 3) == pytest.approx([0.05] * 3)


def test_the_hold_and_the_peak_round_trip_through_the_state() -> None:
    optimizer, scheduler = _loop(_blowup)
    lr = LRControl(optimizer)
    _train(lr, optimizer, scheduler, 21)
    lr.hold()
    state = lr.state_dict()
    again = LRControl(optimizer)
    again.load_state_dict(state)
    assert again.state_dict() == state
    old = LRControl(optimizer)
    old.load_state_dict({"scale": 0.5})  # a checkpoint written before the hold
    assert (old.scale, old.peak, old.hold_jumps) == (0.5, None, False)


def test_a_hold_that_arrives_during_a_jump_holds_it_at_once_and_gives_the_schedule_back() -> None:
    """An LR-induced rise answered without a rollback (issue 38: char_lm ended at 0.244x its
    schedule with a x0.1 factor): the jump now on is held at the peak from before it, and the
    step the schedule falls back the LR is the schedule's."""
    optimizer, scheduler = _loop(_blowup)
    lr = LRControl(optimizer)
    applied = _train(lr, optimizer, scheduler, 23)  # three updates at x50 (steps 20-22)
    assert applied[20:] == pytest.approx([5.0] * 3)
    assert "held at 0.1" in lr.hold()
    applied = _train(lr, optimizer, scheduler, 17)  # steps 23-39
    assert applied == pytest.approx([0.1] * 17)
    assert lr.scale == 1.0 and not lr.holding and lr.jump_base is None
    assert lr.peak == pytest.approx(0.1)


def test_no_jump_on_when_the_schedule_is_back() -> None:
    optimizer, scheduler = _loop(_blowup)
    lr = LRControl(optimizer)
    _train(lr, optimizer, scheduler, 32)  # the jump came and went
    assert lr.jump_base is None
    assert "held at 5" in lr.hold()  # armed for the next one, nothing held now
    assert _train(lr, optimizer, scheduler, 3) == pytest.approx([0.1] * 3)
