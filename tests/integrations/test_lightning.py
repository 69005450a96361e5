"""The Lightning callback against a real Lightning Trainer: steps, skips, LR, stop, rollback, checkpoints."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("lightning")

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from integrations_helpers import action, acks, send, steps
from spikeguard.integrations.lightning import SpikeguardCallback
from spikeguard.producers.config import GuardConfig
from spikeguard.schemas import AckStatus, ActionKind


class Regression(L.LightningModule):
    def __init__(self, poison_step: int | None = None, warmup: int = 4, total: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.poison_step, self.warmup, self.total = poison_step, warmup, total

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step == self.poison_step:
            x = x * math.nan
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        w, t = self.warmup, self.total
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (s + 1) / w if s < w else max(0.0, (t - s) / (t - w))
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(L.Callback):
    def __init__(self, on_begin=None) -> None:
        self.on_begin = on_begin
        self.global_steps: list[int] = []
        self.params_before: dict[int, list[torch.Tensor]] = {}
        self.params_after: dict[int, list[torch.Tensor]] = {}
        self.used_lr: dict[int, float] = {}
        self.scheduled_lr: dict[int, float] = {}
        self.adam_steps: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        self.params_before[step] = [p.detach().clone() for p in pl_module.parameters()]
        state = trainer.optimizers[0].state
        self.adam_steps[step] = float(state[next(iter(state))]["step"]) if state else 0.0
        if self.on_begin is not None:
            self.on_begin(trainer, step)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.global_steps.append(trainer.global_step)
        # (after the guard's hook; Lightning runs this inside optimizer.step(closure), right
        # before the optimizer's math: the LR it is about to use)
        self.used_lr[trainer.global_step] = float(optimizer.param_groups[0]["lr"])
        self.scheduled_lr[trainer.global_step] = trainer.lr_scheduler_configs[
            0
        ].scheduler.get_last_lr()[0]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.global_steps:  # (a micro-batch of an accumulation before the first step: none)
            self.params_after[self.global_steps[-1]] = [
                p.detach().clone() for p in pl_module.parameters()
            ]


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 6, generator=g)
    y = x @ torch.randn(6, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=g)


def fit(
    tmp_path,
    bus,
    module,
    max_steps: int,
    recorder: Recorder,
    box: dict | None = None,
    mode: str = "protect",
    **trainer_kw,
):
    L.seed_everything(0, verbose=False)
    guard = SpikeguardCallback(
        run_id="pl-test",
        bus=bus,
        mode=mode,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False, checkpoint_every=5),
    )
    if box is not None:
        box["guard"] = guard
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[guard, recorder],
        **trainer_kw,
    )
    trainer.fit(module, loader())
    return trainer, guard


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_step_numbers_are_lightnings_global_step(tmp_path, bus):
    rec = Recorder()
    trainer, guard = fit(tmp_path, bus, Regression(), 12, rec)
    assert rec.global_steps == list(range(12))
    assert [e.step for e in steps(bus)] == rec.global_steps
    assert guard.guard.step_count == trainer.global_step == 12


def test_step_numbers_with_gradient_accumulation(tmp_path, bus):
    rec = Recorder()
    trainer, guard = fit(tmp_path, bus, Regression(), 6, rec, accumulate_grad_batches=3)
    events = steps(bus)
    assert [e.step for e in events] == list(range(6))
    assert [e.batch_index for e in events] == [
        2,
        5,
        8,
        11,
        14,
        17,
    ]  # the last micro-batch of each step


def test_a_skipped_update_changes_nothing_adamw_would_change(tmp_path, bus):
    rec = Recorder()
    fit(tmp_path, bus, Regression(poison_step=6), 9, rec)
    assert same(rec.params_before[6], rec.params_after[6])
    assert not same(rec.params_before[5], rec.params_after[5])
    assert rec.adam_steps[7] == rec.adam_steps[6] == 6.0  # AdamW did not count the skipped step
    events = {e.step: e for e in steps(bus)}
    assert events[6].update_skipped and events[6].skip_reason == "non_finite"


def test_lr_action_scales_the_schedulers_value_and_leaves_the_schedule_alone(tmp_path, bus):
    box: dict = {}

    def scale_at_8(trainer, step):
        if step == 8:
            send(bus, box["guard"].guard, action(ActionKind.SCALE_LR, 8, "pl-test", factor=0.5))

    rec = Recorder(on_begin=scale_at_8)
    trainer, guard = fit(tmp_path, bus, Regression(), 16, rec, box)
    for step in range(16):
        assert rec.used_lr[step] == pytest.approx(
            rec.scheduled_lr[step] * (0.5 if step >= 8 else 1.0)
        ), step
    assert rec.scheduled_lr[12] == pytest.approx(1e-2 * (16 - 12) / (16 - 4))
    opt = trainer.optimizers[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(
        trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
    )
    assert [a.status for a in acks(bus) if a.kind == ActionKind.SCALE_LR] == [AckStatus.APPLIED]


def test_stop_action_ends_the_fit_cleanly(tmp_path, bus):
    box: dict = {}

    def stop_at_7(trainer, step):
        if step == 7:
            send(bus, box["guard"].guard, action(ActionKind.STOP, 7, "pl-test", reason="test stop"))

    rec = Recorder(on_begin=stop_at_7)
    trainer, guard = fit(tmp_path, bus, Regression(), 30, rec, box)
    assert trainer.global_step == 8 and rec.global_steps[-1] == 7
    assert same(rec.params_before[7], rec.params_after[7])
    assert guard.guard.should_stop and not guard.guard.finished
    assert [a.status for a in acks(bus) if a.kind == ActionKind.STOP] == [AckStatus.APPLIED]


def test_rollback_restores_model_optimizer_and_scheduler(tmp_path, bus):
    """Rolled back at step 13 to step 10: model, AdamW moments and the schedule are step 10's
    again; Lightning's global_step cannot be set, so the count goes on, in a new epoch."""
    box: dict = {}
    first: dict = {}

    def rollback_at_13(trainer, step):
        opt = trainer.optimizers[0]
        snapshot = (
            [p.detach().clone() for p in trainer.lightning_module.parameters()],
            [v["exp_avg"].clone() for v in opt.state.values()] if opt.state else [],
            trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        )
        first.setdefault(step, snapshot)
        if step == 13 and box["guard"].guard.generation == 0:
            send(
                bus, box["guard"].guard, action(ActionKind.ROLLBACK, 13, "pl-test", target_step=10)
            )
        if step == 14:
            box["after"] = snapshot

    rec = Recorder(on_begin=rollback_at_13)
    trainer, guard = fit(tmp_path, bus, Regression(total=40), 20, rec, box)
    params, moments, sched_epoch = box["after"]
    assert (
        same(params, first[10][0]) and same(moments, first[10][1]) and sched_epoch == first[10][2]
    )
    assert guard.guard.counters["rollbacks"] == 1 and trainer.global_step == 20
    events = steps(bus)
    assert [(e.epoch, e.step) for e in events] == [(0, s) for s in range(13)] + [
        (1, s) for s in range(14, 20)
    ]
    assert [a.status for a in acks(bus) if a.kind == ActionKind.ROLLBACK] == [AckStatus.APPLIED]


def test_guard_state_travels_in_lightnings_checkpoint(tmp_path, bus):
    box: dict = {}

    def scale_at_3(trainer, step):
        if step == 3:
            send(bus, box["guard"].guard, action(ActionKind.SCALE_LR, 3, "pl-test", factor=0.25))

    trainer, guard = fit(tmp_path, bus, Regression(), 6, Recorder(on_begin=scale_at_3), box)
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    again = SpikeguardCallback(
        run_id="pl-test",
        bus=bus,
        config=GuardConfig(
            checkpoint_dir=str(tmp_path / "ckpt2"), resume=False, checkpoint_every=5
        ),
    )
    resumed = L.Trainer(
        max_steps=8,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[again],
    )
    resumed.fit(Regression(), loader(), ckpt_path=str(path))
    assert again.guard.lr.scale == 0.25  # the LR factor survived the restart
    assert again.guard.stream.position >= 6 and resumed.global_step == 8


def test_observe_mode_trains_through_a_due_rollback_as_guard_step_does(tmp_path, bus):
    """Observe mode says a rollback and applies nothing: the step it was due at trains and is
    published, as under ``guard.step`` (the callback calls the same two halves)."""
    box: dict = {}

    def rollback_at_13(trainer, step):
        if step == 13:
            send(
                bus, box["guard"].guard, action(ActionKind.ROLLBACK, 13, "pl-test", target_step=10)
            )

    rec = Recorder(on_begin=rollback_at_13)
    trainer, guard = fit(tmp_path, bus, Regression(total=40), 16, rec, box, mode="observe")
    assert not same(rec.params_before[13], rec.params_after[13])  # the update was applied
    assert [(e.epoch, e.step) for e in steps(bus)] == [(0, s) for s in range(16)]
    assert [a.status for a in acks(bus)] == [AckStatus.REJECTED]
    assert guard.guard.summary().withheld == {"rollback": 1}
