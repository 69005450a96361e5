"""A Guard with the mechanism signals: they ride on its step events, and it applies qk_clip itself."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

from spikeguard.producers.evidence import StepView, disagreement
from spikeguard.producers.signals import MechanismSignals, layer_groups
from spikeguard.producers.signals.prevention import Prevention
from spikeguard.producers.signals.qk_clip import fused_qk_heads
from spikeguard.schemas import AckStatus, ActionKind, AnomalyType, Claim, StepEvent, Topics, decode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from producers_helpers import acks, action, make_guard, send


class Block(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Attending:
    """A one-block attention model whose query/key rows start 8x too large (logits ~64x)."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(Block())
        with torch.no_grad():
            self.model[0].qkv.weight[:16] *= 8.0
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        x = torch.randn(64, 6, 8)
        self.loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(x, x.roll(1, dims=1)), batch_size=8
        )

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return loss


def _attach(guard, net: Attending) -> Prevention:
    blocks = list(net.model)
    signals = MechanismSignals(
        {"0": blocks[0].qkv}, layers=layer_groups(net.model, ["0"]), qkv_heads=2
    )
    return Prevention(guard, signals, fused_qk_heads(blocks))


def _run(guard, net: Attending, steps: int) -> None:
    data = guard.data(net.loader, max_steps=steps)
    while guard.step_count < steps:
        for batch in data:
            guard.step(net.loss(batch))
    guard.publisher.flush(5.0)


def _steps(bus) -> list[StepEvent]:
    return [decode(r.value, StepEvent) for r in bus.read_all(Topics().steps)]


@pytest.mark.heavy  # a Guard trains a few steps (~2-6 s on a loaded box)
def test_step_events_carry_the_signals_and_qk_clip_holds_the_logits_at_its_threshold(bus, tmp_path):
    net = Attending()
    guard = make_guard(net, bus, tmp_path)
    prevention = _attach(guard, net)
    _run(guard, net, 3)
    before = _steps(bus)
    assert [e.step for e in before] == [0, 1, 2]
    peak = max(e.attention_logit_max for e in before)
    assert peak > 20.0 and all(0.0 < e.update_ratio < 1.0 for e in before)
    threshold = peak / 4
    send(bus, action(ActionKind.QK_CLIP, 3, threshold=threshold), guard=guard)
    _run(guard, net, 8)
    guard.close()
    (ack,) = [a for a in acks(bus) if a.kind is ActionKind.QK_CLIP]
    assert ack.status is AckStatus.APPLIED and f"in force at {threshold:.3g}" in ack.result
    after = [e for e in _steps(bus) if e.step >= 4]
    assert len(after) == 4
    assert all(e.attention_logit_max <= threshold * 1.05 for e in after)
    assert prevention.qk_threshold == threshold and prevention.clipped_heads >= 2


@pytest.mark.heavy  # a Guard trains a few steps (~2-6 s on a loaded box)
def test_a_qk_clip_over_what_the_trainer_measures_changes_no_weight(bus, tmp_path):
    weights = []
    for threshold in (None, 1e6):
        net = Attending()
        guard = make_guard(net, bus, tmp_path / str(threshold), run_id=f"r{threshold}")
        _attach(guard, net)
        _run(guard, net, 2)
        if threshold is not None:
            send(
                bus,
                action(ActionKind.QK_CLIP, 2, f"r{threshold}", threshold=threshold),
                guard=guard,
            )
        _run(guard, net, 5)
        guard.close()
        weights.append(net.model[0].qkv.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])
    (ack,) = [a for a in acks(bus) if a.kind is ActionKind.QK_CLIP]
    assert ack.status is AckStatus.APPLIED and ack.result.endswith("rescaled now: none")


@pytest.mark.heavy  # a Guard trains a few steps (~2-6 s on a loaded box)
def test_a_guard_without_the_signals_publishes_none_and_cannot_apply_qk_clip(bus, tmp_path):
    net = Attending()
    guard = make_guard(net, bus, tmp_path)
    _run(guard, net, 2)
    send(bus, action(ActionKind.QK_CLIP, 2, threshold=1.0), guard=guard)
    _run(guard, net, 3)
    guard.close()
    assert all(e.attention_logit_max is None and e.update_ratio is None for e in _steps(bus))
    (ack,) = [a for a in acks(bus) if a.kind is ActionKind.QK_CLIP]
    assert ack.status is AckStatus.UNHANDLED


def test_an_attention_growth_claim_needs_the_trainer_s_own_signals_over_their_bar():
    claim = Claim(step=13, type=AnomalyType.ATTENTION_LOGIT_GROWTH)
    calm = StepView(2.0, 1.0)
    assert disagreement(claim, calm) is not None
    assert disagreement(claim, calm._replace(signal_over=True)) is None
    spike = Claim(step=13, type=AnomalyType.LOSS_SPIKE)  # the signals back no other type
    assert disagreement(spike, calm._replace(signal_over=True)) is not None
