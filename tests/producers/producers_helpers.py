"""Helpers of the producers tests: a tiny real model, real data, actions on a bare bus."""

from __future__ import annotations

import itertools
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from spikeguard.schemas.signing import sign_action
from spikeguard.producers import Guard, GuardConfig
from spikeguard.schemas import Ack, Action, ActionKind, Topics, decode, encode

_ids = itertools.count()


class Tiny:
    """A small regression problem: model, optimizer, loader (64 batches of 8)."""

    def __init__(
        self,
        seed: int = 0,
        n: int = 512,
        batch_size: int = 8,
        lr: float = 1e-2,
        noise: float = 0.05,
    ) -> None:
        torch.manual_seed(seed)
        self.x = torch.randn(n, 6)
        self.y = self.x @ torch.randn(6, 1) + noise * torch.randn(n, 1)
        self.loader = DataLoader(TensorDataset(self.x, self.y), batch_size=batch_size, shuffle=True)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def make_guard(tiny: Tiny, bus, tmp_path, run_id: str = "r1", *, scheduler=None, **config) -> Guard:
    defaults = dict(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=10, resume=False)
    return Guard(
        tiny.model,
        tiny.optimizer,
        scheduler,
        run_id=run_id,
        bus=bus,
        config=GuardConfig(**{**defaults, **config}),
    )


def action(
    kind: ActionKind,
    at: int,
    run_id: str = "r1",
    key: str | None = None,
    decision_id: str | None = None,
    **params,
) -> Action:
    a = Action(
        action_id=f"a-test-{next(_ids)}",
        run_id=run_id,
        kind=kind,
        apply_at_step=at,
        params=params,
        decision_id=decision_id,
    )
    return sign_action(a, key) if key else a


def send(bus, *actions: Action, guard: Guard | None = None) -> None:
    """Publish ``actions``; with ``guard``, wait until its inbox has received those of its run."""
    producer = bus.producer()
    before = guard.inbox._handed if guard is not None else 0
    for a in actions:
        producer.publish(Topics().actions, encode(a), key=a.run_id)
    if guard is not None:
        mine = sum(a.run_id == guard.run_id for a in actions)
        deadline = time.monotonic() + 10
        while guard.inbox._handed < before + mine and time.monotonic() < deadline:
            time.sleep(0.002)
        assert guard.inbox._handed >= before + mine, "the guard's inbox did not receive the actions"


def acks(bus) -> list[Ack]:
    return [decode(r.value, Ack) for r in bus.read_all(Topics().acks)]


def train(guard: Guard, tiny: Tiny, steps: int, on_step=None) -> None:
    """Run until the guard's step counter reaches ``steps``, whatever rollbacks happen."""
    data = guard.data(tiny.loader, max_steps=steps)
    while guard.step_count < steps and not guard.should_stop:
        for batch in data:
            if on_step:
                on_step(guard, data, batch)
            guard.step(tiny.loss(batch))
    guard.publisher.flush(5.0) if guard.publisher else None


def noisy_regression() -> DataLoader:
    """The lockstep recovery runs' data: a linear target under unit noise (gradient norms of
    1.5-3.5), 128 shuffled batches of 32."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 8, generator=generator)
    w = torch.randn(8, 1, generator=generator)
    y = x @ w + torch.randn(4096, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)


def lockstep_regression_guard(runtime, tmp_path, run_id: str, policy: dict) -> tuple:
    """A seeded MLP, its SGD optimizer and its lockstep Guard on ``runtime`` (checkpoints every
    10 steps, 8 kept): ``(guard, model, optimizer)``; train it on :func:`noisy_regression`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = GuardConfig(
        checkpoint_dir=str(tmp_path / run_id),
        checkpoint_every=10,
        keep_checkpoints=8,
        lockstep=True,
        lockstep_timeout=30.0,
        data_seed=0,
    )
    guard = Guard(model, optimizer, run_id=run_id, config=config, runtime=runtime, policy=policy)
    return guard, model, optimizer
