"""A tiny lab model's attention-logit growth reproduces, seeded, and QK-layernorm prevents it."""

from __future__ import annotations

import pytest
import torch

from spikeguard.lab.instability.data import CharText
from spikeguard.lab.instability.train import Recipe, train
from spikeguard.lab.instability.warning import SIGNALS, first_warning

TINY = Recipe(
    steps=60,
    d_model=32,
    layers=1,
    heads=2,
    block=16,
    batch_size=8,
    lr=0.05,
    warmup=10,
    eval_batches=1,
)
ATTENTION = next(s for s in SIGNALS if s.name == "attention_max")


@pytest.mark.heavy  # ~1 s of training a run on a quiet core, plus torch's optimizer import
def test_attention_logits_grow_at_high_lr_without_qk_norm():
    torch.set_num_threads(1)
    text = CharText(TINY.block)
    unstable = train(TINY, seed=0, text=text)
    again = train(TINY, seed=0, text=text)
    twin = train(TINY.with_(qk_norm=True), seed=0, text=text)
    assert unstable.losses == again.losses  # seeded: the same run twice
    warned = first_warning(unstable, ATTENTION)
    assert warned is not None and 20 < warned < 60  # grew past the threshold, not from the start
    assert first_warning(twin, ATTENTION) is None
    assert max(r.signals.max_attention_logit for r in twin.steps) < 20
