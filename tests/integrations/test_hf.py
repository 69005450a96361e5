"""The HuggingFace Trainer callback against a real Trainer: steps, skips, LR, stop, rollback."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from integrations_helpers import action, acks, send, steps
from spikeguard.integrations.hf import SpikeguardCallback
from spikeguard.producers.config import GuardConfig
from spikeguard.schemas import AckStatus, ActionKind


class Tokens(Dataset):
    def __init__(self, n: int = 256, length: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 32, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(TrainerCallback):
    """What the Trainer did at each step (registered after the guard: sees its decisions)."""

    def __init__(self, on_begin=None) -> None:
        self.on_begin = on_begin
        self.global_steps: list[int] = []  # state.global_step at each optimizer step
        self.params_before: dict[int, list[torch.Tensor]] = {}
        self.params_after: dict[int, list[torch.Tensor]] = {}
        self.used_lr: list[tuple[int, float]] = []
        self.scheduled_lr: list[tuple[int, float]] = []
        self.state = None

    def on_train_begin(self, args, state, control, optimizer=None, **kw):
        self.state = state
        optimizer.optimizer.register_step_pre_hook(  # after the guard's hook: the LR really used
            lambda opt, *a: self.used_lr.append(
                (state.global_step, float(opt.param_groups[0]["lr"]))
            )
        )

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.params_before[state.global_step] = [p.detach().clone() for p in model.parameters()]
        if self.on_begin is not None:
            self.on_begin(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, lr_scheduler=None, **kw):
        self.global_steps.append(state.global_step)
        self.scheduled_lr.append((state.global_step, lr_scheduler.get_last_lr()[0]))

    def on_step_end(self, args, state, control, model=None, **kw):
        self.params_after[self.global_steps[-1]] = [p.detach().clone() for p in model.parameters()]


def tiny_gpt2() -> GPT2LMHeadModel:
    """A one-layer GPT-2 of 16 dimensions, the same weights every time (seed 0)."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    )


def trainer_args(tmp_path, steps: int, **extra) -> TrainingArguments:
    """The tests' TrainingArguments: CPU, seed 0, batches of 8, no clipping of the Trainer's own
    (the Guard sees the true gradient norm), nothing saved; ``extra`` on top."""
    base = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=8,
        max_grad_norm=0.0,
        seed=0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    return TrainingArguments(**{**base, **extra})


def run(tmp_path, bus, steps_: int = 20, recorder: Recorder | None = None, **config) -> tuple:
    model = tiny_gpt2()
    guard = SpikeguardCallback(
        run_id="hf-test",
        bus=bus,
        config=GuardConfig(
            checkpoint_dir=str(tmp_path / "ckpt"), resume=False, **{"checkpoint_every": 5, **config}
        ),
    )
    recorder = recorder or Recorder()
    args = trainer_args(
        tmp_path,
        steps_,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        weight_decay=0.1,
        logging_steps=10_000,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[guard, recorder])
    trainer.train()
    return trainer, guard, recorder


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_step_numbers_are_the_trainers_global_step(tmp_path, bus):
    trainer, guard, rec = run(tmp_path, bus, steps_=12)
    published = [e.step for e in steps(bus)]
    assert rec.global_steps == list(range(12))
    assert published == rec.global_steps
    assert guard.guard.step_count == trainer.state.global_step == 12


def test_a_skipped_update_changes_nothing_adamw_would_change(tmp_path, bus):
    """A NaN loss at step 6: its update is skipped, though AdamW with weight decay would move
    every weight even for zero gradients; the optimizer's own step count stays put too."""
    counts = {}

    def poison(step):
        counts[step] = (
            int(trainer_opt[0].state[next(iter(trainer_opt[0].state))]["step"])
            if step and trainer_opt
            else None
        )

    trainer_opt: list = []

    class Poison(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            trainer_opt.append(optimizer.optimizer)
            model.lm_head.register_forward_hook(
                lambda m, a, out: (
                    out * float("nan") if m.training and state.global_step == 6 else None
                )
            )

    rec = Recorder(on_begin=poison)
    model = tiny_gpt2()
    guard = SpikeguardCallback(
        run_id="hf-test",
        bus=bus,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False, checkpoint_every=5),
    )
    args = trainer_args(tmp_path, 9, learning_rate=1e-2, weight_decay=0.1)
    Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[Poison(), guard, rec]
    ).train()
    assert same(rec.params_before[6], rec.params_after[6])  # skipped: not a weight moved
    assert not same(rec.params_before[5], rec.params_after[5])  # a normal step moves them
    assert counts[7] == counts[6] == 6  # AdamW's step count did not count the skipped step
    events = {e.step: e for e in steps(bus)}
    assert events[6].update_skipped and events[6].skip_reason == "non_finite"
    assert guard.guard.counters["skipped_updates"] == 1


def test_lr_action_scales_the_schedulers_value_and_leaves_the_schedule_alone(tmp_path, bus):
    box: dict = {}

    def scale_at_8(step):
        if step == 8:
            send(bus, box["guard"].guard, action(ActionKind.SCALE_LR, 8, "hf-test", factor=0.5))

    rec = Recorder(on_begin=scale_at_8)
    model = tiny_gpt2()
    box["guard"] = guard = SpikeguardCallback(
        run_id="hf-test",
        bus=bus,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False, checkpoint_every=5),
    )
    args = trainer_args(
        tmp_path, 16, learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=4
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[guard, rec])
    trainer.train()
    used, scheduled = dict(rec.used_lr), dict(rec.scheduled_lr)
    for step in range(16):
        factor = 0.5 if step >= 8 else 1.0
        assert used[step] == pytest.approx(scheduled[step] * factor, rel=1e-9), step
    # the schedule underneath went on as scheduled: linear decay to 0 after a 4-step warm-up
    assert scheduled[12] == pytest.approx(1e-2 * (16 - 12) / (16 - 4))
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(
        trainer.lr_scheduler.get_last_lr()[0]
    )
    assert [a.status for a in acks(bus) if a.kind == ActionKind.SCALE_LR] == [AckStatus.APPLIED]


def test_stop_action_ends_training_cleanly(tmp_path, bus):
    box: dict = {}

    def stop_at_7(step):
        if step == 7:
            send(bus, box["guard"].guard, action(ActionKind.STOP, 7, "hf-test", reason="test stop"))

    rec = Recorder(on_begin=stop_at_7)
    model = tiny_gpt2()
    box["guard"] = guard = SpikeguardCallback(
        run_id="hf-test",
        bus=bus,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False, checkpoint_every=5),
    )
    args = trainer_args(tmp_path, 30)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[guard, rec])
    out = trainer.train()  # returns normally
    assert trainer.state.global_step == 8 and rec.global_steps[-1] == 7
    assert same(rec.params_before[7], rec.params_after[7])  # the stopping step's update is void
    assert out.global_step == 8
    assert guard.guard.should_stop and not guard.guard.finished
    assert [a.status for a in acks(bus) if a.kind == ActionKind.STOP] == [AckStatus.APPLIED]


@pytest.mark.heavy
def test_rollback_restores_model_optimizer_scheduler_and_global_step(tmp_path, bus):
    """Rolled back at step 13 to step 10: the state is the one step 10 started from, the Trainer's
    global_step is 10 again, the data goes on with the next batch, and the run still ends at 20."""
    box: dict = {}
    optim_states: dict = {}

    def rollback_at_13(step):
        opt = box["trainer"].optimizer
        optim_states.setdefault(step, []).append(
            {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
            if opt.state_dict()["state"]
            else None
        )
        if step == 13 and box["guard"].guard.generation == 0:
            send(
                bus, box["guard"].guard, action(ActionKind.ROLLBACK, 13, "hf-test", target_step=10)
            )

    rec = Recorder(on_begin=rollback_at_13)
    model = tiny_gpt2()
    box["guard"] = guard = SpikeguardCallback(
        run_id="hf-test",
        bus=bus,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False, checkpoint_every=5),
    )
    args = trainer_args(tmp_path, 20, learning_rate=1e-2, lr_scheduler_type="linear")
    first_params: dict = {}

    class Keep(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            first_params.setdefault(
                state.global_step, [p.detach().clone() for p in model.parameters()]
            )

    box["trainer"] = trainer = Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[guard, rec, Keep()]
    )
    trainer.train()
    assert rec.global_steps == list(range(14)) + list(range(10, 20))
    assert trainer.state.global_step == 20 and guard.guard.counters["rollbacks"] == 1
    # after the rollback step 10 starts from the state step 10 started from the first time
    assert same(rec.params_before[10], first_params[10])
    first, again = optim_states[10]
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert dict(rec.scheduled_lr)[10] == pytest.approx(1e-2 * (20 - 10) / 20)
    events = steps(bus)
    assert [(e.epoch, e.step) for e in events] == [(0, s) for s in range(13)] + [
        (1, s) for s in range(10, 20)
    ]
    # the data went on: epoch 1's step 10 read the batch after step 13's, not step 10's again
    batch = {(e.epoch, e.step): e.batch_index for e in events}
    assert batch[(1, 10)] == 14 and batch[(0, 10)] == 10
    assert [a.status for a in acks(bus) if a.kind == ActionKind.ROLLBACK] == [AckStatus.APPLIED]


def test_published_loss_is_the_trainers_own_with_gradient_accumulation(tmp_path, bus):
    """4 micro-batches per step: one StepEvent per optimizer step, numbered by global_step,
    with the loss the Trainer itself logs for that step (its micro-batch losses added up)."""
    logged: dict[int, float] = {}

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                logged[state.global_step - 1] = logs["loss"]

    model = tiny_gpt2()
    guard = SpikeguardCallback(
        run_id="hf-test",
        bus=bus,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False, checkpoint_every=5),
    )
    args = trainer_args(
        tmp_path, 6, per_device_train_batch_size=4, gradient_accumulation_steps=4, logging_steps=1
    )
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[guard, Logs()]).train()
    events = steps(bus)
    assert [e.step for e in events] == list(range(6))
    assert [e.batch_index for e in events] == [3, 7, 11, 15, 19, 23]  # the last micro-batch of each
    for e in events:
        assert e.loss == pytest.approx(logged[e.step], abs=2e-4)  # (the Trainer rounds its logs)


def test_rollback_at_the_last_step_still_trains_to_max_steps(tmp_path, bus):
    box: dict = {}

    def rollback_at_13(step):
        if step == 13 and box["guard"].guard.generation == 0:
            send(
                bus, box["guard"].guard, action(ActionKind.ROLLBACK, 13, "hf-test", target_step=10)
            )

    rec = Recorder(on_begin=rollback_at_13)
    model = tiny_gpt2()
    box["guard"] = guard = SpikeguardCallback(
        run_id="hf-test",
        bus=bus,
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False, checkpoint_every=5),
    )
    args = trainer_args(tmp_path, 14, logging_steps=5)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[guard, rec])
    trainer.train()
    assert rec.global_steps == list(range(14)) + list(range(10, 14))
    assert trainer.state.global_step == 14 and guard.guard.finished


def test_observe_mode_in_the_trainer_applies_nothing_and_resume_defaults_as_the_guard(
    tmp_path, bus
):
    box: dict = {}

    def stop_at_7(step):
        if step == 7:
            send(
                bus,
                box["guard"].guard,
                action(ActionKind.STOP, 7, "hf-test", reason="test stop"),
                action(ActionKind.SCALE_LR, 7, "hf-test", factor=0.5),
            )

    rec = Recorder(on_begin=stop_at_7)
    model = tiny_gpt2()
    box["guard"] = guard = SpikeguardCallback(
        run_id="hf-test",
        bus=bus,
        mode="observe",
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=5),
    )
    args = trainer_args(tmp_path, 12, learning_rate=1e-2)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[guard, rec])
    trainer.train()
    assert trainer.state.global_step == 12  # not stopped
    assert dict(rec.used_lr)[10] == pytest.approx(dict(rec.scheduled_lr)[10])  # LR not scaled
    assert {a.kind: a.status for a in acks(bus)} == {
        ActionKind.STOP: AckStatus.REJECTED,
        ActionKind.SCALE_LR: AckStatus.REJECTED,
    }
    assert guard.guard.summary().withheld == {"stop": 1, "scale_lr": 1}
    assert guard.guard.config.resume == GuardConfig().resume  # the same default as the plain Guard


def test_observe_mode_trains_through_a_due_rollback_as_guard_step_does(tmp_path, bus):
    """Observe mode says a rollback and applies nothing: the step it was due at trains and is
    published, as under ``guard.step`` (the callback calls the same two halves)."""
    box: dict = {}

    def rollback_at_13(step):
        if step == 13:
            send(
                bus, box["guard"].guard, action(ActionKind.ROLLBACK, 13, "hf-test", target_step=10)
            )

    rec = Recorder(on_begin=rollback_at_13)
    model = tiny_gpt2()
    box["guard"] = guard = SpikeguardCallback(
        run_id="hf-test",
        bus=bus,
        mode="observe",
        config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False, checkpoint_every=5),
    )
    args = trainer_args(tmp_path, 16, learning_rate=1e-2)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[guard, rec])
    trainer.train()
    assert rec.global_steps == list(range(16)) and trainer.state.global_step == 16
    assert not same(rec.params_before[13], rec.params_after[13])  # the update was applied
    assert [(e.epoch, e.step) for e in steps(bus)] == [(0, s) for s in range(16)]
    assert [a.status for a in acks(bus)] == [AckStatus.REJECTED]
    assert guard.guard.summary().withheld == {"rollback": 1}
