"""Gradient accumulation: one guard.step per optimizer step, skips counted in both units.

How to call the Guard with accumulation (ACCUM micro-batches per optimizer step):
iterate ``guard.data(loader)`` for the micro-batches, backward each (loss / ACCUM),
and call ``guard.step(mean loss)`` once, after the last micro-batch's backward.
The Guard notes which batches each step read, so a skip window given in steps
skips all their micro-batches.
"""

from __future__ import annotations

import torch
from producers_helpers import Tiny, acks, action, make_guard, send

from spikeguard.producers import checkpoint_id
from spikeguard.schemas import ActionKind, StepEvent, decode

K = ActionKind
ACCUM = 4


def _train(guard, tiny, steps, poison_step=None):
    data = guard.data(tiny.loader, epochs=20, max_steps=steps)
    it = iter(data)
    firsts = {}  # (epoch, step) -> first batch index the step read
    while guard.step_count < steps:
        tiny.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros(())
        key = (guard.generation, guard.step_count)
        for i in range(ACCUM):
            x, y = next(it)
            if i == 0:
                firsts[key] = data.last_index
            if key == poison_step:
                x = x * float("nan")
            loss = torch.nn.functional.mse_loss(tiny.model(x), y) / ACCUM
            loss.backward()
            total += loss.detach()
        guard.step(total)
    return firsts


def test_skip_window_in_steps_covers_every_micro_batch_and_reports_both_counts(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=5)
    send(
        bus,
        action(
            K.ROLLBACK, 10, decision_id="d", target_step=5, checkpoint_id=checkpoint_id("r1", 5, 0)
        ),
        action(K.SKIP_BATCHES, 10, decision_id="d", from_step=5, to_step=7, extra=2),
        guard=guard,
    )
    firsts = _train(guard, tiny, 14)
    guard.close()
    assert firsts[(0, 5)] == 20 and firsts[(0, 9)] == 36
    # steps 5..7 read batches 20..31; two more steps' worth is 32..39; the re-run starts at 40
    assert firsts[(1, 5)] == 40
    assert guard.loader.skip_ranges == [[20, 39]]
    assert guard.counters["skipped_batches"] == 20 and guard.counters["skipped_steps"] == 5
    result = {a.kind: a.result for a in acks(bus)}[K.SKIP_BATCHES]
    assert result == "skipping batches 20..39 (20 micro-batches, 5 optimizer steps)"


def test_a_skipped_update_counts_one_optimizer_step_and_its_micro_batches(bus, topics, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    _train(guard, tiny, 6, poison_step=(0, 3))
    guard.close()
    assert (
        guard.counters["skipped_updates"] == 1 and guard.counters["skipped_update_batches"] == ACCUM
    )
    assert guard.counters["updates"] == 5
    events = [decode(r.value, StepEvent) for r in bus.read_all(topics.steps)]
    assert [e.batch_index for e in events] == [3, 7, 11, 15, 19, 23]  # each step's last micro-batch
    assert [e.skip_reason for e in events] == [None, None, None, "non_finite", None, None]
