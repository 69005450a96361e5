"""Parameter bounds and the rollback-target book."""

from __future__ import annotations

import pytest

from spikeguard.actuators.bounds import (
    MAX_LR_LOG,
    BatchSizeFactor,
    ClipNorm,
    Eps,
    LrFactor,
    effective_decrease,
    effective_increase,
)
from spikeguard.actuators.checkpoints import CheckpointBook
from spikeguard.schemas import CheckpointEvent


@pytest.mark.parametrize(
    "current, factor, floor, expected",
    [
        (1.0, 0.5, 0.05, 0.5),
        (0.08, 0.5, 0.05, 0.625),  # stops at the floor
        (0.05, 0.5, 0.05, 1.0),  # at the floor: nothing to do
    ],
)
def test_effective_decrease(current: float, factor: float, floor: float, expected: float) -> None:
    assert effective_decrease(current, factor, floor) == pytest.approx(expected)
    assert current * effective_decrease(current, factor, floor) >= floor - 1e-12


@pytest.mark.parametrize(
    "current, factor, expected", [(0.4, 1.25, 1.25), (0.9, 1.25, 1 / 0.9), (1.0, 1.25, 1.0)]
)
def test_effective_increase(current: float, factor: float, expected: float) -> None:
    assert effective_increase(current, factor) == pytest.approx(expected)


def test_lr_factor_history_and_rewind() -> None:
    lr = LrFactor(floor=0.05)
    assert lr.decrease(10, 0.5) == 0.5
    assert lr.decrease(20, 0.5) == 0.5
    assert lr.restore(30, 1.25) == 1.25
    assert (lr.at(5), lr.at(10), lr.at(19), lr.at(20), lr.at(99)) == (1.0, 0.5, 0.5, 0.25, 0.3125)
    assert lr.rewind(15) == 0.5  # the timeline after step 15 is abandoned
    assert lr.current == 0.5 and lr.at(99) == 0.5


def test_lr_factor_never_leaves_its_bounds() -> None:
    lr = LrFactor(floor=0.1)
    sent = [lr.decrease(step, 0.3) for step in range(5)]
    assert sent[:2] == [0.3, pytest.approx(0.1 / 0.3)] and sent[2:] == [None, None, None]
    assert lr.current == pytest.approx(0.1)
    restored = [lr.restore(100 + step, 2.0) for step in range(6)]
    assert restored[-1] is None and lr.current == 1.0
    lr.set(200, 5.0)
    assert lr.current == 1.0
    lr.set(201, 0.0001)
    assert lr.current == 0.1


def test_lr_log_is_bounded_and_folds_into_the_baseline() -> None:
    lr = LrFactor(floor=0.01)
    for step in range(2 * MAX_LR_LOG):
        lr.set(step, 0.5 if step % 2 else 0.25)
    assert len(lr.log) == MAX_LR_LOG
    assert lr.at(2 * MAX_LR_LOG) == 0.5
    lr.forget_before(2 * MAX_LR_LOG - 10)
    assert len(lr.log) <= 10 and lr.at(2 * MAX_LR_LOG - 10) == 0.25
    restored = LrFactor(floor=0.01)
    restored.load_state_dict(lr.state_dict())
    assert restored.log == lr.log and restored.baseline == lr.baseline


def test_clip_enables_then_tightens_within_bounds() -> None:
    clip = ClipNorm(initial=1.0, tighten=0.5, low=0.2, high=10.0)
    assert clip.enable_or_tighten() == 1.0
    assert clip.enable_or_tighten() == 0.5
    assert clip.enable_or_tighten() == 0.25
    assert clip.enable_or_tighten() == 0.2
    assert clip.enable_or_tighten() is None and clip.norm == 0.2


def test_clip_floor_never_loosens() -> None:
    clip = ClipNorm(initial=1.0, tighten=0.5, low=0.1, high=10.0)
    assert clip.enable_or_tighten(floor=0.5) == 1.0
    assert clip.enable_or_tighten(floor=0.5) == 0.5
    assert clip.enable_or_tighten(floor=0.5) is None
    clip.norm = 0.25
    assert clip.enable_or_tighten(floor=0.5) is None and clip.norm == 0.25


def test_batch_size_and_eps_bounds() -> None:
    batch = BatchSizeFactor(floor=0.25)
    assert [batch.decrease(0.5), batch.decrease(0.5), batch.decrease(0.5)] == [0.5, 0.5, None]
    eps = Eps(initial=1e-8, high=1e-6)
    assert eps.increase(10) == pytest.approx(1e-7)
    assert eps.increase(100) == pytest.approx(1e-6)
    assert eps.increase(10) is None


# --- rollback targets ----------------------------------------------------------------------------------
def _event(step: int, healthy: bool = True, cid: str | None = None) -> CheckpointEvent:
    return CheckpointEvent(run_id="r", step=step, checkpoint_id=cid or f"c{step}", healthy=healthy)


def test_target_is_newest_healthy_far_enough_before_onset() -> None:
    book = CheckpointBook(capacity=8)
    for step in (100, 200, 300):
        book.add(_event(step))
    book.add(_event(350, healthy=False))
    assert book.target(onset_step=400, min_steps_before=100).step == 300
    assert book.target(onset_step=399, min_steps_before=100).step == 200
    assert book.target(onset_step=460, min_steps_before=100).step == 300  # 350 is unhealthy
    assert book.target(onset_step=150, min_steps_before=100) is None


def test_unhealthy_checkpoints_never_push_out_healthy_ones() -> None:
    book = CheckpointBook(capacity=3)
    book.add(_event(100))
    for step in range(110, 500, 10):
        book.add(_event(step, healthy=False))
    assert [c.step for c in book.healthy] == [100]
    for step in (600, 700, 800):
        book.add(_event(step))
    assert [c.step for c in book.healthy] == [600, 700, 800]  # bounded, newest kept
    assert book.newest_step == 800 and book.unhealthy_seen == 39


def test_redelivered_checkpoint_is_not_duplicated() -> None:
    book = CheckpointBook(capacity=8)
    book.add(_event(100))
    book.add(_event(100))
    book.add(_event(100, cid="c100-epoch1"))  # the re-run wrote a new checkpoint at the same step
    assert [(c.step, c.checkpoint_id) for c in book.healthy] == [(100, "c100-epoch1")]


def test_drop_after_and_put_back() -> None:
    book = CheckpointBook(capacity=8)
    for step in (100, 200, 300, 400):
        book.add(_event(step))
    dropped = book.drop_after(200)
    assert [c.step for c in book.healthy] == [100, 200] and [c.step for c in dropped] == [300, 400]
    book.put_back(dropped, except_id="c200")
    book.discard("c200")
    assert [c.step for c in book.healthy] == [100, 300, 400]
    restored = CheckpointBook(capacity=8)
    restored.load_state_dict(book.state_dict())
    assert restored.healthy == book.healthy
