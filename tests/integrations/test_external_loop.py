"""The Guard's two halves, driven by a hand-written stand-in for a framework's loop."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from integrations_helpers import action, acks, send, steps
from spikeguard.producers.config import GuardConfig
from spikeguard.producers.external_loop import BatchStream, FrameworkGuard
from spikeguard.schemas import AckStatus, ActionKind


def framework(tmp_path, bus, n_steps: int, before_step=None) -> FrameworkGuard:
    """A loop that owns optimizer.step() and scheduler.step(), like a framework's."""
    torch.manual_seed(0)
    x = torch.randn(512, 6)
    y = x @ torch.randn(6, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    guard = FrameworkGuard(
        model,
        opt,
        sched,
        run_id="ext",
        bus=bus,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False, checkpoint_every=5),
    )
    step = 0
    for xb, yb in loader:
        if step >= n_steps:
            break
        if before_step is not None:
            before_step(guard, step)
        guard.batch_read()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        guard.before_update(loss, step=step)
        opt.step()
        sched.step()
        guard.after_update()
        step = guard.step_count  # the framework's counter follows a rollback (as HF's does)
    guard.close()
    return guard


def test_skip_window_ahead_voids_the_steps_that_read_it_and_does_not_publish_them(tmp_path, bus):
    def skip_at_6(guard, step):
        if step == 6:  # batches of steps 4..5, and 3 steps' worth after: 4..8
            send(
                bus,
                guard,
                action(ActionKind.SKIP_BATCHES, 6, "ext", from_step=4, to_step=5, extra=3),
            )

    guard = framework(tmp_path, bus, 12, skip_at_6)
    published = [e.step for e in steps(bus)]
    assert published == [0, 1, 2, 3, 4, 5, 9, 10, 11]  # steps 6..8 read batches 6..8: voided
    assert guard.stream.skip_ranges == [[4, 8]]
    assert guard.counters["updates"] == 9 and guard.counters["skipped_updates"] == 0
    assert [a.status for a in acks(bus)] == [AckStatus.APPLIED]


def test_lr_factor_is_on_top_of_the_scheduler_and_never_compounds(tmp_path, bus):
    used: list[float] = []

    def scale_at_2(guard, step):
        if step == 0:
            guard.optimizer.register_step_pre_hook(
                lambda o, *a: used.append(o.param_groups[0]["lr"])
            )
        if step == 2:
            send(bus, guard, action(ActionKind.SCALE_LR, 2, "ext", factor=0.1))

    guard = framework(tmp_path, bus, 10, scale_at_2)
    scheduled = [1e-2 * 0.5 ** (s // 4) for s in range(10)]
    expected = [lr * (0.1 if s >= 2 else 1.0) for s, lr in enumerate(scheduled)]
    assert used == [round(v, 12) for v in used] and all(
        abs(u - e) < 1e-12 for u, e in zip(used, expected)
    )
    assert abs(guard.optimizer.param_groups[0]["lr"] - 1e-2 * 0.5 ** (10 // 4)) < 1e-12


def test_batch_stream_never_goes_back_but_merges_skips():
    stream = BatchStream()
    for _ in range(10):
        stream.read()
    stream.skip(12, 14)
    stream.load_state_dict({"position": 4, "skip_ranges": [[20, 21]]})  # a rollback's older state
    assert stream.position == 10 and stream.skip_ranges == [[12, 14], [20, 21]]
    fresh = BatchStream()
    fresh.load_state_dict(stream.state_dict())  # a restarted process takes the saved count
    assert fresh.position == 10 and fresh.skip_ranges == stream.skip_ranges
    assert [fresh.read() for _ in range(5)] == [False, False, True, True, True]


def test_a_decisions_action_needs_the_framework_guards_own_numbers_to_agree(tmp_path, bus):
    from spikeguard.schemas import AnomalyType, Claim

    def claimed(kind: ActionKind, at: int, step: int, type_: AnomalyType, **params):
        return action(kind, at, "ext", **params).model_copy(
            update={"decision_id": f"d-{step}-{kind.value}", "claim": Claim(step=step, type=type_)}
        )

    sent = {}

    def spike_at_40(guard, step):
        if step == 40:  # the weights blown up: this step's loss is far out
            with torch.no_grad():
                for p in guard.model.parameters():
                    p.mul_(30.0)
        if step == 42:
            sent["healthy"] = claimed(
                ActionKind.SCALE_LR, 42, 38, AnomalyType.EXTREME_LOSS, factor=0.5
            )
            sent["spike"] = claimed(ActionKind.CLIP, 42, 40, AnomalyType.EXTREME_LOSS, max_norm=1.0)
            send(bus, guard, sent["healthy"], sent["spike"])

    guard = framework(tmp_path, bus, 45, spike_at_40)
    by_id = {a.action_id: a for a in acks(bus)}
    assert by_id[sent["healthy"].action_id].status is AckStatus.REJECTED
    assert "this trainer saw" in by_id[sent["healthy"].action_id].result
    assert by_id[sent["spike"].action_id].status is AckStatus.APPLIED
    assert guard.clipper.settings()["max_norm"] == 1.0
