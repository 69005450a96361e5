"""The mechanism signals read the right values off hand-built tensors and modules."""

from __future__ import annotations

import math

import torch
from torch import nn

from spikeguard.producers.signals import (
    AttentionLogitMax,
    AttentionScores,
    LogPartition,
    MechanismSignals,
    UpdateRatio,
)
from spikeguard.producers.signals.attention import fused_qkv_logits


def test_attention_max_is_the_largest_visible_q_dot_k_per_head():
    scores = AttentionScores()
    probe = AttentionLogitMax({"0": scores})
    q = torch.zeros(2, 2, 3, 4)  # batch 2, heads 2, time 3, head_dim 4
    k = torch.zeros(2, 2, 3, 4)
    q[1, 0, 2, 1], k[1, 0, 0, 1] = 4.0, 2.5  # head 0: query 2 sees key 0: 4*2.5/sqrt(4) = 5
    q[0, 1, 0, 3], k[0, 1, 2, 3] = 10.0, 10.0  # head 1: key 2 is after query 0: masked, ignored
    q[0, 1, 2, 0], k[0, 1, 1, 0] = -1.0, 3.0  # head 1's largest visible logit is 0 (zeros)
    logits = scores(q, k)
    assert torch.allclose(logits, q @ k.transpose(-2, -1) / 2)
    assert probe.collect()["0"].tolist() == [5.0, 0.0]
    assert probe.collect() == {}  # collected once
    probe.close()
    scores(q, k)
    assert probe.collect() == {}  # no hook after close


def test_fused_qkv_hook_forms_the_same_logits_as_the_attention():
    torch.manual_seed(0)
    d, heads = 8, 2
    qkv = nn.Linear(d, 3 * d)
    x = torch.randn(3, 5, d)
    probe = AttentionLogitMax({"layer": qkv}, qkv_heads=heads)
    out = qkv(x)
    q, k, _ = out.view(3, 5, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    expected = (q @ k.transpose(-2, -1)) / math.sqrt(d // heads)
    assert torch.allclose(fused_qkv_logits(out, heads), expected)
    visible = expected.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -math.inf)
    want = visible.amax(dim=(0, 2, 3))
    assert torch.allclose(probe.collect()["layer"], want)


def test_log_partition_is_the_mean_logsumexp():
    head = nn.Identity()
    probe = LogPartition(head)
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])  # log 2 and log 4
    head(logits)
    assert math.isclose(probe.collect(), (math.log(2) + math.log(4)) / 2, rel_tol=1e-6)
    assert math.isnan(probe.collect())


def test_update_ratio_per_layer():
    a, b = nn.Linear(2, 2, bias=False), nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        a.weight.copy_(torch.tensor([[3.0, 0.0], [0.0, 4.0]]))  # norm 5
        b.weight.copy_(torch.tensor([[1.0, 0.0]]))  # norm 1
    ratio = UpdateRatio({"a": list(a.parameters()), "b": list(b.parameters())})
    for _ in range(2):  # the buffers are reused from the second step on
        ratio.before()
        with torch.no_grad():
            a.weight[0, 0] += 0.5
            b.weight[0, 1] -= 2.0
        ratio.after()
        got = ratio.collect()
    assert math.isclose(got["b"], 2.0 / math.hypot(1.0, 2.0), rel_tol=1e-6)
    assert math.isclose(got["a"], 0.5 / math.hypot(3.5, 4.0), rel_tol=1e-6)


def test_mechanism_signals_collects_all_three_at_once():
    torch.manual_seed(0)
    scores, head, layer = AttentionScores(), nn.Linear(4, 6), nn.Linear(4, 4)
    signals = MechanismSignals({"0": scores}, head, {"layer": list(layer.parameters())})
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    scores(q, k)
    logits = head(torch.randn(1, 3, 4))
    signals.before_update()
    with torch.no_grad():
        layer.weight.mul_(1.5)
        layer.bias.mul_(1.5)
    signals.after_update()
    got = signals.collect()
    want_att = (q @ k.transpose(-2, -1) / 2).masked_fill(
        torch.ones(3, 3, dtype=torch.bool).triu(1), -math.inf
    )
    assert got.attention_max["0"] == want_att.amax(dim=(0, 2, 3)).tolist()
    assert math.isclose(got.z, float(torch.logsumexp(logits.detach(), -1).mean()), rel_tol=1e-6)
    assert math.isclose(got.update_ratio["layer"], 0.5, rel_tol=1e-5)
    assert got.max_attention_logit == max(got.attention_max["0"])
    assert math.isnan(MechanismSignals().collect().z)
