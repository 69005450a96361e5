"""QK-clip returns a head's max logit to the threshold; the LR cut follows the evidence."""

from __future__ import annotations

import math

import pytest
import torch

from spikeguard.lab.instability.model import LabGPT, ModelConfig
from spikeguard.lab.instability.responses import LRCut, QKClip, ZLossOn, lab_qk_heads
from spikeguard.producers.signals import AttentionLogitMax, StepSignals


class Knobs:
    lr_scale = 1.0
    z_loss = 0.0


def test_qk_clip_brings_only_the_offending_head_back_to_the_threshold():
    torch.manual_seed(0)
    model = LabGPT(ModelConfig(vocab=11, block=8, d_model=16, layers=1, heads=2))
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.q.weight[:8].normal_(std=2.0)  # head 0's queries and keys: large logits
        attn.k.weight[:8].normal_(std=2.0)
    probe = AttentionLogitMax(model.attention_scores())
    x = torch.randint(0, 11, (4, 8))
    model(x)
    before = probe.collect()["0"].tolist()
    assert before[0] > 30.0 > before[1]
    clip = QKClip(lab_qk_heads(model), threshold=30.0)
    said = clip.after_step(0, StepSignals(attention_max={"0": before}), Knobs())
    assert said is not None and said.startswith("qk_clip 0.0:")
    model(x)
    after = probe.collect()["0"].tolist()
    assert after[0] == pytest.approx(
        30.0, rel=1e-4
    )  # the same batch: exactly back at the threshold
    assert after[1] == pytest.approx(before[1], rel=1e-6)  # the other head is untouched
    assert clip.after_step(1, StepSignals(attention_max={"0": after}), Knobs()) is None


def test_lr_cut_is_scaled_to_the_evidence_and_restored_when_calm():
    knobs, cut = Knobs(), LRCut(threshold=0.05, calm_steps=3)
    assert cut.after_step(0, StepSignals(update_ratio={"0": 0.04}), knobs) is None
    assert "lr_cut" in cut.after_step(1, StepSignals(update_ratio={"0": 0.2}), knobs)
    assert knobs.lr_scale == pytest.approx(0.25)
    # at the cut LR the ratio is 0.25 x what the full LR would give: 0.03 means 0.12, which the
    # cut already answers; 0.1 means 0.4: cut further
    assert cut.after_step(2, StepSignals(update_ratio={"0": 0.03}), knobs) is None
    assert "lr_cut" in cut.after_step(2, StepSignals(update_ratio={"0": 0.1}), knobs)
    assert knobs.lr_scale == pytest.approx(0.05 / 0.4)
    scale = knobs.lr_scale
    calm = StepSignals(update_ratio={"0": 0.01 * scale})  # the full LR would give 0.01
    said = [cut.after_step(3 + i, calm, knobs) for i in range(3)]
    assert said[:2] == [None, None] and "lr_restore" in said[2]
    assert knobs.lr_scale == pytest.approx(2 * scale)


def test_z_loss_on_after_a_drift():
    knobs, z = Knobs(), ZLossOn(coefficient=1e-4, drift=1.0, after=2)
    assert z.after_step(1, StepSignals(z=9.0), knobs) is None  # before `after`
    assert z.after_step(2, StepSignals(z=4.0), knobs) is None  # the reference
    assert z.after_step(3, StepSignals(z=4.9), knobs) is None
    assert "z_loss on" in z.after_step(4, StepSignals(z=2.5), knobs)
    assert knobs.z_loss == 1e-4
    assert math.isclose(z.reference, 4.0)
