"""A loss that falls fast and then sits at its floor (a converged run) is healthy.

The standard "can my model learn?" check overfits one batch: the loss falls by
four orders of magnitude in ~1,500 steps and then sits at the floor its input
noise gives, with ~18 % step-to-step noise (issue 38's report: 503 ``slow_rise``
alerts and an LR cut for a ``divergence`` in 40k steps). What its climb test
learned while the loss fell ("a healthy run goes down by this much") is no bar
for a loss that stopped falling: a loss that stops falling is no rise.
"""

from __future__ import annotations

import math
import random

import pytest

from spikeguard.processors.detectors.level import LevelCode
from spikeguard.processors.detectors.statistical import StatisticalConfig

QUIET = {LevelCode.OK, LevelCode.WARMUP, LevelCode.OUTLIER}


def fall_then_floor(n: int, seed: int, tau: float = 110.0, noise: float = 0.18) -> list[float]:
    """log(loss): a fall ``exp(-t / tau)`` onto a floor of 8.5e-5 whose own noise is ``noise``
    (log units): the shape of the one-batch MLP's loss (bench_embedded_memory.py)."""
    rng = random.Random(seed)
    return [
        math.log(math.exp(-t / tau) + 8.5e-5 * math.exp(rng.gauss(0.0, noise))) for t in range(n)
    ]


def linear_fall_then_floor(n: int, seed: int, fall: int = 1500, noise: float = 0.18) -> list[float]:
    """log(loss): a straight fall from 0 to log(8.5e-5) over ``fall`` steps, then flat, with
    ``noise`` throughout."""
    rng = random.Random(seed)
    floor = math.log(8.5e-5)
    return [floor * min(1.0, t / fall) + rng.gauss(0.0, noise) for t in range(n)]


def judged_codes(ys: list[float], lr: float = 0.01) -> dict[LevelCode, list[int]]:
    monitor = StatisticalConfig().level.monitor()
    codes: dict[LevelCode, list[int]] = {}
    for step, y in enumerate(ys):
        judged = monitor.judge(y, lr)
        codes.setdefault(judged.code, []).append(step)
        monitor.advance(y, judged, lr)
    return codes


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tau", [110.0, 150.0])
def test_a_loss_at_its_floor_after_a_fast_fall_is_not_a_climb(seed, tau) -> None:
    # (a climb null fitted on the fall has its bar below zero: every point of the floor
    # was a climb there, and none joined the null to correct it)
    codes = judged_codes(fall_then_floor(6000, seed, tau))
    loud = {code.name: steps[:5] for code, steps in codes.items() if code not in QUIET}
    assert loud == {}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_loss_at_its_floor_after_a_straight_fall_is_not_a_rise(seed) -> None:
    # (the rise test's tails fitted on the fall: bars below zero, only the +10 % floor left)
    codes = judged_codes(linear_fall_then_floor(8000, seed))
    loud = {code.name: steps[:5] for code, steps in codes.items() if code not in QUIET}
    assert loud == {}


def test_a_climb_after_a_fast_fall_and_a_floor_is_still_found() -> None:
    # The same run, then the loss climbs x3 over 300 steps from step 6000: a divergence.
    ys = fall_then_floor(6000, 0)[:6000] + [
        math.log(8.5e-5) + math.log(3.0) * min(1.0, t / 300) + random.Random(9).gauss(0.0, 0.18)
        for t in range(600)
    ]
    codes = judged_codes(ys)
    found = [
        s
        for c in (LevelCode.CLIMB, LevelCode.DIVERGENCE, LevelCode.SLOW_RISE, LevelCode.SPIKE)
        for s in codes.get(c, [])
    ]
    assert found and 6000 <= min(found) <= 6400


def one_batch_mlp_losses(steps: int) -> list[float]:
    """benchmarks/bench_embedded_memory.py's loop, unguarded: a small MLP overfits one batch."""
    torch = pytest.importorskip("torch")
    from torch import nn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (a tiny model: threads only contend on a shared box)
    try:
        return _train(torch, nn, steps)
    finally:
        torch.set_num_threads(threads)


def _train(torch, nn, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x + 0.01 * torch.randn_like(x)), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.heavy  # (2,000 steps of a real torch loop and the whole pipeline: ~2-4 s)
def test_a_real_model_overfitting_one_batch_is_healthy_to_the_whole_pipeline() -> None:
    # Before: 62 anomalous decisions in these 2,000 steps (LOW level shifts from step 1,626 on;
    # in 40k steps 10,849, and a `loss_climb` divergence at step 36,571 that cut the LR).
    from spikeguard.lab.backtest import backtest_events
    from spikeguard.schemas import StepEvent

    losses = one_batch_mlp_losses(2000)
    events = [
        StepEvent(run_id="one-batch", step=i + 1, loss=v, lr=0.01, time=float(i))
        for i, v in enumerate(losses)
    ]
    flagged = [(d.step, d.type.value) for d in backtest_events(events) if d.is_anomaly]
    assert [kind for _, kind in flagged if kind != "outlier_step"] == [], flagged[:5]
