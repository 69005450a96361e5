"""Actions applied for real, each acknowledged with its result."""

from __future__ import annotations

import math

import torch
from producers_helpers import Tiny, acks, action, make_guard, send, train

from spikeguard.producers import set_optimizer_eps
from spikeguard.schemas import AckStatus, ActionKind, CheckpointEvent, StepEvent, decode

K = ActionKind


def _by_kind(bus):
    return {a.kind: a for a in acks(bus)}


def test_lr_actions_scale_every_group_and_restore_never_above_base(bus, topics, tmp_path):
    tiny = Tiny()
    tiny.optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 2e-2})
    guard = make_guard(tiny, bus, tmp_path)
    send(
        bus,
        action(K.SCALE_LR, 3, factor=0.25),
        action(K.RESTORE_LR, 5, factor=2.0),
        action(K.RESTORE_LR, 7, factor=10.0),
        action(K.SET_LR, 9, lr=1e-3),
        guard=guard,
    )
    seen = {}

    def spy(g, data, batch):
        seen[g.step_count] = [float(grp["lr"]) * g.lr.scale for grp in g.optimizer.param_groups]

    train(guard, tiny, 12, on_step=spy)
    guard.close()
    events = {e.step: e for e in (decode(r.value, StepEvent) for r in bus.read_all(topics.steps))}
    assert events[2].lr == 1e-2 and events[3].lr == 2.5e-3 and events[5].lr == 5e-3
    assert events[7].lr == 1e-2  # restore capped at the base LR
    assert events[9].lr == 1e-3
    assert seen[4] == [2.5e-3, 5e-3]  # every param group scaled alike
    # the scheduled LR in the optimizer is never overwritten by the guard
    assert [g["lr"] for g in tiny.optimizer.param_groups] == [1e-2, 2e-2]
    assert all(a.status is AckStatus.APPLIED for a in acks(bus))


def test_fixed_clip_limits_the_update_gradient(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    send(bus, action(K.CLIP, 2, max_norm=0.01), action(K.CLIP, 4, max_norm=5.0), guard=guard)
    norms = []
    tiny.optimizer.register_step_pre_hook(
        lambda opt, *a: norms.append(
            float(torch.nn.utils.get_total_norm([p.grad for p in tiny.model.parameters()]))
        )
    )
    train(guard, tiny, 6)
    guard.close()
    assert norms[0] > 0.02 and all(n <= 0.0101 for n in norms[2:])  # tightened, never loosened
    assert guard.clipper.max_norm == 0.01
    results = [a.result for a in acks(bus)]
    assert results == ["clipping at max_norm=0.01", "clipping at max_norm=0.01"]


def test_adaptive_clip_cuts_a_gradient_spike(bus, tmp_path):
    tiny = Tiny()
    # (no local skip: the spike's update must reach the clipper)
    guard = make_guard(tiny, bus, tmp_path, clip_warmup=10, skip_outliers=False)
    send(bus, action(K.CLIP, 0, mode="adaptive", z=3.0), guard=guard)
    norms = []
    tiny.optimizer.register_step_pre_hook(
        lambda opt, *a: norms.append(
            float(torch.nn.utils.get_total_norm([p.grad for p in tiny.model.parameters()]))
        )
    )

    def spike(g, data, batch):
        if g.step_count == 30:
            batch[1].mul_(1000.0)

    train(guard, tiny, 32, on_step=spike)
    guard.close()
    baseline = max(norms[10:30])
    assert norms[30] < 3 * baseline  # without clipping it would be ~1000x
    assert guard.clipper.clipped >= 1


def test_checkpoint_stop_alert_and_events(bus, topics, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=0)
    send(
        bus,
        action(K.CHECKPOINT, 3, reason="on_demand"),
        action(K.ALERT, 4, severity="info", message="hi"),
        action(K.STOP, 6, reason="enough"),
        guard=guard,
    )
    train(guard, tiny, 50)
    guard.close()
    assert guard.should_stop and guard.step_count == 6 and guard.stop_reason == "enough"
    by = _by_kind(bus)
    assert by[K.CHECKPOINT].status is AckStatus.APPLIED and "at step 4" in by[K.CHECKPOINT].result
    assert by[K.ALERT].result == "alert logged" and by[K.STOP].result == "stopping"
    events = [decode(r.value, CheckpointEvent) for r in bus.read_all(topics.checkpoints)]
    assert [(e.step, e.reason) for e in events] == [(0, "periodic"), (4, "on_demand")]


def test_handler_only_kinds_unhandled_handled_or_failed(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    tiny.optimizer.param_groups[0]["eps"] = 1e-8
    guard.on(K.SET_EPS, set_optimizer_eps)
    guard.on(K.ALERT, lambda a, g: (_ for _ in ()).throw(RuntimeError("pager down")))
    send(
        bus,
        action(K.REDUCE_BATCH_SIZE, 1, factor=0.5),
        action(K.SET_EPS, 2, eps=1e-6),
        action(K.ALERT, 3, severity="x", message="m"),
        guard=guard,
    )
    train(guard, tiny, 5)
    guard.close()
    by = _by_kind(bus)
    assert by[K.REDUCE_BATCH_SIZE].status is AckStatus.UNHANDLED
    assert (
        by[K.SET_EPS].status is AckStatus.APPLIED and tiny.optimizer.param_groups[0]["eps"] == 1e-6
    )
    assert by[K.ALERT].status is AckStatus.FAILED and "pager down" in by[K.ALERT].result


def test_bad_parameters_fail_without_killing_training(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    send(
        bus,
        action(K.SCALE_LR, 1, factor=-2),
        action(K.SET_LR, 1, lr=float("nan")),
        action(K.ROLLBACK, 2, target_step=0, checkpoint_id="c-missing"),
        action(K.SKIP_BATCHES, 3, from_step=5, to_step=4, extra=0),
        guard=guard,
    )
    train(guard, tiny, 6)
    guard.close()
    statuses = [(a.kind, a.status) for a in acks(bus)]
    assert statuses[:2] == [(K.SCALE_LR, AckStatus.FAILED), (K.SET_LR, AckStatus.FAILED)]
    # no checkpoint with that id: falls back to the newest healthy at or before the target
    assert statuses[2] == (K.ROLLBACK, AckStatus.APPLIED)
    assert guard.lr.scale == 1.0 and guard.generation == 1


def _naming_step_0(bus, bare, key):
    from spikeguard.producers.actions import operator_evidence
    from spikeguard.schemas import Topics, sign_action

    step0 = next(
        e for e in (decode(r.value, StepEvent) for r in bus.read_all(Topics().steps)) if e.step == 0
    )
    return sign_action(bare.model_copy(update={"evidence": operator_evidence(step0)}), key)


def test_signatures_duplicates_lateness_and_other_runs(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, signing_key="k3y")
    train(guard, tiny, 1)  # with a key, a state-changing action names a step the trainer published
    good = _naming_step_0(bus, action(K.SCALE_LR, 2, factor=0.5), "k3y")
    forged = action(K.SCALE_LR, 2, factor=0.1, key="wrong")
    unsigned = action(K.SCALE_LR, 2, factor=0.1)
    other_run = action(K.SCALE_LR, 2, factor=0.1, run_id="someone-else", key="k3y")
    send(
        bus, good, forged, unsigned, other_run, good, guard=guard
    )  # the good one twice (re-delivery)
    train(guard, tiny, 6)
    late = _naming_step_0(bus, action(K.SCALE_LR, 1, factor=0.5), "k3y")
    send(bus, late, guard=guard)
    train(guard, tiny, 8)
    guard.close()
    got = {(a.action_id, a.status) for a in acks(bus)}
    assert (good.action_id, AckStatus.APPLIED) in got and (
        good.action_id,
        AckStatus.DUPLICATE,
    ) in got
    assert (forged.action_id, AckStatus.REJECTED) in got and (
        unsigned.action_id,
        AckStatus.REJECTED,
    ) in got
    assert all(a.action_id != other_run.action_id for a in acks(bus))
    late_ack = next(a for a in acks(bus) if a.action_id == late.action_id)
    assert late_ack.status is AckStatus.APPLIED and late_ack.result.startswith(
        "late (due at step 1)"
    )
    assert late_ack.step >= 6
    assert math.isclose(guard.lr.scale, 0.25)


def test_a_handler_beside_a_checkpoint_action_leaves_it_its_one_ack(bus, tmp_path):
    """A CHECKPOINT is acked once its file is on disk; a handler registered for the kind runs
    when the action is applied and must not ack it early ("None; handler: ..."), a second time."""
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=0)
    seen = []
    guard.on(K.CHECKPOINT, lambda a, g: seen.append(a.action_id) or "noted")
    wanted = action(K.CHECKPOINT, 2, reason="on_demand")
    send(bus, wanted, guard=guard)
    train(guard, tiny, 4)
    guard.saver.wait()
    guard.checkpoints.drain()
    mine = [a for a in guard.applied if a["action_id"] == wanted.action_id]
    guard.close()
    assert seen == [wanted.action_id]
    assert [a["status"] for a in mine] == [AckStatus.APPLIED.value], mine
    assert not mine[0]["result"].startswith("None"), mine
