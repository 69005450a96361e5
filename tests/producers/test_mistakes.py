"""A loop's common mistakes with the Guard are caught and named, on a real small torch loop."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from producers_helpers import Tiny, acks, action, make_guard, send

from spikeguard.producers import Guard
from spikeguard.producers.misuse import GuardMisuse
from spikeguard.schemas import AckStatus, ActionKind


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_guard_step_twice_for_one_batch_is_an_error_before_the_second_update(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    with pytest.raises(GuardMisuse, match="called twice for one batch"):
        for batch in guard.data(tiny.loader):
            loss = tiny.loss(batch)
            guard.step(loss)
            guard.step(loss)
    assert guard.counters["updates"] == 1
    guard.close()


def test_guard_step_twice_with_a_recomputed_loss_is_caught_by_the_data(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    with pytest.raises(GuardMisuse, match="twice for one batch"):
        for batch in guard.data(tiny.loader):
            guard.step(tiny.loss(batch))
            guard.step(tiny.loss(batch))
    assert guard.counters["updates"] == 1
    guard.close()


def test_the_loader_itself_iterated_after_guard_data_is_named(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    guard.data(tiny.loader)
    with pytest.raises(GuardMisuse, match="iterate the wrapped loader"):
        for batch in tiny.loader:
            guard.step(tiny.loss(batch))
    guard.close()


def test_optimizer_step_left_in_the_loop_is_an_error(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    with pytest.raises(GuardMisuse, match=r"optimizer.step\(\) was called besides guard.step"):
        for batch in guard.data(tiny.loader):
            loss = tiny.loss(batch)
            tiny.optimizer.step()
            guard.step(loss)
    assert guard.counters["updates"] == 0
    guard.close()


def test_scheduler_step_left_in_the_loop_is_an_error(bus, tmp_path):
    """The scheduler handed to the Guard and stepped by the loop too: the schedule ran twice as
    fast, silently (a StepLR(50, 0.5) at 0.003 after 120 steps instead of 0.0125)."""
    tiny = Tiny()
    scheduler = torch.optim.lr_scheduler.StepLR(tiny.optimizer, 50, 0.5)
    guard = make_guard(tiny, bus, tmp_path, scheduler=scheduler)
    with pytest.raises(GuardMisuse, match=r"scheduler.step\(\) was called besides guard.step"):
        for batch in guard.data(tiny.loader):
            guard.step(tiny.loss(batch))
            scheduler.step()
    assert guard.counters["updates"] == 1 and scheduler.last_epoch == 2
    guard.close()


@pytest.mark.parametrize("loss", ["0.12", np.array(0.12), np.ones(3), [0.12]])
def test_a_loss_that_is_not_a_tensor_or_a_number_is_a_type_error(bus, tmp_path, loss):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    batch = next(iter(guard.data(tiny.loader)))
    tiny.loss(batch)
    with pytest.raises(TypeError, match="the scalar torch.Tensor you called backward"):
        guard.step(loss)
    guard.close()


def test_a_per_sample_loss_vector_says_to_reduce_it(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    x, y = next(iter(guard.data(tiny.loader)))
    per_sample = torch.nn.functional.mse_loss(tiny.model(x), y, reduction="none").squeeze(1)
    per_sample.mean().backward()
    with pytest.raises(ValueError, match=r"shape \(8,\).*loss.mean\(\)"):
        guard.step(per_sample)
    guard.close()


def test_a_guard_config_setting_passed_to_guard_points_at_guard_config():
    tiny = Tiny()
    with pytest.raises(TypeError, match=r"config=GuardConfig\(max_grad_norm=1.0\)"):
        Guard(tiny.model, tiny.optimizer, connect=False, max_grad_norm=1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument colour.*GuardConfig"):
        Guard(tiny.model, tiny.optimizer, connect=False, colour="red")


def test_without_guard_data_a_warning_at_the_start_and_a_rollback_without_skip_noise(
    bus, tmp_path, caplog
):
    caplog.set_level(logging.WARNING)
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    why = dict(decision_id="d-1", reason="loss spike at step 28")
    send(
        bus,
        action(ActionKind.ROLLBACK, 30, target_step=20, **why),
        action(ActionKind.SKIP_BATCHES, 30, from_step=21, to_step=28, extra=4, **why),
        guard=guard,
    )
    caplog.clear()  # (what building the Guard said)
    batches = iter(tiny.loader)  # the user's own loader, never given to guard.data
    while guard.step_count < 40:
        guard.step(tiny.loss(next(batches)))
    guard.close()
    said = _warnings(caplog)
    assert said[0].startswith("spikeguard: run r1: guard.data(loader) was not called"), said[:2]
    assert sum("guard.data(loader) was not called" in m for m in said) == 1
    by = {a.kind: a for a in acks(bus)}
    assert by[ActionKind.ROLLBACK].status is AckStatus.APPLIED
    skip = by[ActionKind.SKIP_BATCHES]
    assert skip.status is AckStatus.REJECTED and "cannot skip batches" in skip.result
    assert not any("no batch index known" in m or "failed" in m for m in said)
    assert guard.counters["rollbacks"] == 1 and guard.counters["skipped_batches"] == 0


def test_observe_mode_on_a_nan_run_says_each_line_once_and_counts_agree(bus, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, mode="observe")
    send(
        bus,
        *(action(ActionKind.ALERT, 12 + i, severity="warning", message="nan") for i in range(5)),
        *(
            action(ActionKind.ROLLBACK, 15 + i, target_step=10, decision_id=f"d{i}")
            for i in range(3)
        ),
        guard=guard,
    )
    for batch in guard.data(tiny.loader, max_steps=60):
        loss = tiny.loss(batch)
        if guard.step_count >= 10:  # the run goes NaN and stays so
            loss = loss * float("nan")
        guard.step(loss)
    summary = guard.close()
    said = _warnings(caplog)
    skips = [m for m in said if m.startswith("spikeguard: would skip the update")]
    assert len(skips) == 2, skips  # the first, then the count
    assert "would skip the update of step 10" in skips[0]
    assert "the same 49 more time(s) up to step 59" in skips[1]
    rollbacks = [m for m in said if m.startswith("spikeguard: would rollback")]
    assert len(rollbacks) == 2 and "the same 2 more time(s)" in rollbacks[1], rollbacks
    assert sum(summary.actions.values()) == guard.counters["actions_applied"] == 0
    assert sum(summary.notices.values()) == guard.counters["notices_applied"] >= 5
    assert summary.notices["alert"] == 5
    assert "also applied: 5 alert" in str(summary)
    assert summary.withheld["skip_update"] == 50 and summary.withheld["rollback"] == 3


def test_a_scheduler_of_the_users_own_without_a_step_count_is_stepped_and_not_watched(
    bus, tmp_path
):
    class Counting:  # a scheduler of one's own: step() only, no last_epoch
        def __init__(self, optimizer):
            self.optimizer, self.steps = optimizer, 0

        def step(self):
            self.steps += 1

        def state_dict(self):
            return {"steps": self.steps}

        def load_state_dict(self, state):
            self.steps = state["steps"]

    tiny = Tiny()
    scheduler = Counting(tiny.optimizer)
    guard = make_guard(tiny, bus, tmp_path, scheduler=scheduler)
    for n, batch in enumerate(guard.data(tiny.loader)):
        guard.step(tiny.loss(batch))
        if n == 4:
            break
    assert scheduler.steps == 5
    guard.close()
