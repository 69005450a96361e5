"""Layer attribution: which layer's gradient moved first before an incident."""

from __future__ import annotations

import pytest

from spikeguard.forensics import attribute
from spikeguard.schemas import StepEvent


def _step(step: int, norms: dict[str, float]) -> StepEvent:
    total = sum(n * n for n in norms.values()) ** 0.5
    return StepEvent(run_id="r", step=step, loss=1.0, grad_norm=total, top_grad_norms=norms)


def _history(blow_at: int, layer: str, factor: float, until: int = 100) -> list[StepEvent]:
    steps = []
    for s in range(until):
        norms = {"a.weight": 1.0 + 0.05 * (s % 3), "b.weight": 0.8, "c.weight": 0.6}
        if s >= blow_at:
            norms[layer] *= factor
        steps.append(_step(s, norms))
    return steps


def test_the_layer_that_blew_up_first_is_named_with_its_share_and_lead():
    steps = _history(blow_at=85, layer="b.weight", factor=30)
    moves = attribute(steps, onset_step=88)
    assert moves[0].layer == "b.weight"
    assert moves[0].first_step == 85 and moves[0].steps_before_onset == 3
    assert moves[0].baseline_share < 0.35 < 0.95 < moves[0].peak_share
    assert moves[0].norm_ratio == pytest.approx(30, rel=0.01)
    assert [m.layer for m in moves] == ["b.weight"]  # the others' shares fell: not suspects


def test_a_uniform_rise_of_every_layer_moves_no_share():
    steps = _history(blow_at=85, layer="a.weight", factor=1.0)
    steps[85:] = [
        _step(e.step, {k: v * 50 for k, v in e.top_grad_norms.items()}) for e in steps[85:]
    ]
    assert attribute(steps, onset_step=88) == []


def test_no_baseline_or_no_layer_norms_gives_nothing():
    assert attribute(_history(5, "a.weight", 30, until=10), onset_step=8) == []
    plain = [StepEvent(run_id="r", step=s, loss=1.0, grad_norm=1.0) for s in range(100)]
    assert attribute(plain, onset_step=90) == []


def test_a_layer_entering_the_top_k_from_nowhere_is_a_suspect():
    steps = []
    for s in range(100):
        norms = {"a.weight": 1.0, "b.weight": 0.9}
        if s >= 90:
            norms = {"a.weight": 1.0, "z.weight": 12.0}
        steps.append(_step(s, norms))
    assert attribute(steps, onset_step=91)[0].layer == "z.weight"
