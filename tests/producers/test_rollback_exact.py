"""A rollback round-trips exactly: parameters as saved, the batch the skip window says."""

from __future__ import annotations

import torch
from producers_helpers import Tiny, acks, action, make_guard, send, train

from spikeguard.producers import checkpoint_id
from spikeguard.schemas import AckStatus, ActionKind, CheckpointEvent, StepEvent, decode


def test_rollback_restores_parameters_data_and_epoch(bus, topics, tmp_path):
    # The order is the unguarded loader's own: read plainly from the same random state.
    reference = {i: x.clone() for i, (x, _) in enumerate(Tiny(seed=1).loader)}
    tiny = Tiny(seed=1)
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=10)
    send(
        bus,
        action(
            K.ROLLBACK,
            27,
            decision_id="d-x",
            target_step=20,
            checkpoint_id=checkpoint_id("r1", 20, 0),
        ),
        action(K.SKIP_BATCHES, 27, decision_id="d-x", from_step=20, to_step=26, extra=3),
        guard=guard,
    )
    saved, after = {}, {}

    def watch(g, data, batch):
        if g.epoch == 0 and g.step_count == 20:
            saved["params"] = tiny.params()
            saved["adam"] = {k: v["exp_avg"].clone() for k, v in tiny.optimizer.state.items()}
        if g.epoch == 1 and "params" not in after:
            after.update(
                step=g.step_count,
                index=data.last_index,
                x=batch[0].clone(),
                params=tiny.params(),
                adam={k: v["exp_avg"].clone() for k, v in tiny.optimizer.state.items()},
            )

    train(guard, tiny, 35, on_step=watch)
    guard.close()
    assert after["step"] == 20
    assert all(torch.equal(a, b) for a, b in zip(saved["params"], after["params"]))
    assert all(torch.equal(saved["adam"][k], after["adam"][k]) for k in saved["adam"])
    assert after["index"] == 30  # batches of steps 20..26 (indices 20..26) + 3 extra skipped
    assert torch.equal(after["x"], reference[30])
    by = {a.kind: a for a in acks(bus)}
    assert by[K.ROLLBACK].status is AckStatus.APPLIED and by[K.ROLLBACK].step == 27
    assert by[K.SKIP_BATCHES].result == "skipping batches 20..29" and by[K.SKIP_BATCHES].step == 20
    steps = [decode(r.value, StepEvent) for r in bus.read_all(topics.steps)]
    assert [(e.epoch, e.step) for e in steps][25:29] == [(0, 25), (0, 26), (1, 20), (1, 21)]
    assert steps[27].batch_index == 30
    ckpts = [decode(r.value, CheckpointEvent) for r in bus.read_all(topics.checkpoints)]
    ckpts = [c for c in ckpts if not c.deleted]  # rotation announcements aside
    assert [(c.epoch, c.step) for c in ckpts] == [(0, 0), (0, 10), (0, 20), (1, 30)]
    assert ckpts[-1].batch_index == 40


def test_applied_ids_survive_the_rollback(bus, tmp_path):
    tiny = Tiny(seed=2)
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=10)
    scale = action(K.SCALE_LR, 12, factor=0.5)
    back = action(K.ROLLBACK, 15, target_step=10, checkpoint_id=checkpoint_id("r1", 10, 0))
    send(bus, scale, back, guard=guard)

    def redeliver(g, data, batch):
        if g.epoch == 1 and g.step_count == 10 and not g.actions.pending:
            send(
                bus, scale, guard=g
            )  # re-delivered once the rollback took the run back before step 12

    train(guard, tiny, 20, on_step=redeliver)
    guard.close()
    statuses = [(a.action_id, a.status) for a in acks(bus)]
    assert statuses == [
        (scale.action_id, AckStatus.APPLIED),
        (back.action_id, AckStatus.APPLIED),
        (scale.action_id, AckStatus.DUPLICATE),
    ]
    assert guard.lr.scale == 1.0  # the checkpoint's (pre-action) LR state, and not re-applied


K = ActionKind


def test_a_late_rollback_whose_target_rotated_out_takes_the_oldest_healthy_checkpoint_before_the_onset(
    bus, tmp_path
):
    # The policy aims 100 steps before the onset; an action that arrives late (a loaded pipeline)
    # can find that checkpoint rotated out. The oldest one still on disk before the incident's
    # onset is the nearest to what was asked, and far better than failing the rollback (which
    # leaves the run to be stopped).
    tiny = Tiny(seed=3)
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=10, keep_checkpoints=4)
    # (rotation alone: with no pulse, the Guard would keep its oldest checkpoint for the
    # decisions not made yet, test_late_decisions.py)
    guard.checkpoints.judged = None
    onset = 55
    back = action(
        K.ROLLBACK,
        75,
        decision_id="d-late",
        target_step=20,
        checkpoint_id=checkpoint_id("r1", 20, 0),
    ).model_copy(update={"incident_id": "i-late", "incident_onset_step": onset})
    send(bus, back, guard=guard)
    train(guard, tiny, 80)
    guard.close()
    (ack,) = [a for a in acks(bus) if a.action_id == back.action_id]
    assert ack.status is AckStatus.APPLIED, ack.result
    # kept at step 75: 40, 50, 60, 70; 60 and 70 lie after the onset
    assert ack.result.startswith("rolled back to step 40 "), ack.result
    assert "not on disk any more" in ack.result and f"before the onset {onset}" in ack.result
    assert guard.generation == 1
