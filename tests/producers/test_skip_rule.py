"""The local skip-step rule: pure, robust, kept clean of outliers, and the same online and offline."""

from __future__ import annotations

import random
import subprocess
import sys

import pydantic
import pytest
import torch
from producers_helpers import Tiny

from spikeguard.producers import Guard, GuardConfig
from spikeguard.producers.skip_rule import SkipRule, scan
from spikeguard.schemas import StepEvent, decode


def _noisy(n: int, seed: int = 0, level: float = 3.0, noise: float = 0.02) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.gauss(0, noise)) for _ in range(n)]


def test_the_rule_imports_without_torch():
    code = ("import sys; import spikeguard.producers.skip_rule as m; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(m.SkipRule().z)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "6.0"


def test_an_isolated_outlier_is_skipped_and_kept_out_of_the_history():
    losses = _noisy(200, noise=0.01)
    spiked = list(losses)
    spiked[150] *= 1.15  # +15 %: the size of the real one-step outliers in data/
    plain, rule = SkipRule(), SkipRule()
    for i, loss in enumerate(spiked):
        decision = rule.decide(loss, 1.0)
        assert decision.skip == (i == 150), i
        if i != 150:
            plain.decide(loss, 1.0)
    assert decision.signal == ""
    assert rule.state_dict() == plain.state_dict()  # as if the outlier never happened


def test_a_gradient_norm_outlier_alone_is_skipped():
    rule = SkipRule()
    norms = _noisy(100, seed=1, level=1.0, noise=0.1)
    for norm in norms:
        assert not rule.decide(3.0, norm).skip
    decision = rule.decide(3.0, 5.0)
    assert decision.skip and decision.signal == "grad_norm" and decision.grad_z > 6


def test_a_small_jump_in_a_very_quiet_run_is_not_skipped():
    rule = SkipRule()
    for loss in _noisy(100, noise=1e-4):
        rule.decide(loss)
    quiet = rule.decide(3.0 * 1.01)  # ~100 robust sigma, but only +1 %
    assert not quiet.skip and quiet.loss_z is None
    assert rule.decide(3.0 * 1.06).skip


def test_a_level_shift_is_skipped_at_most_max_run_times_then_learned():
    losses = _noisy(100) + [x * 1.3 for x in _noisy(300, seed=2)]
    skipped = [i for i, d in enumerate(scan((x, None) for x in losses)) if d.skip]
    assert skipped == [100, 101]  # max_run=2, then the rule stands aside and learns the new level
    spike_after = losses + [losses[-1] * 1.3]  # ...and afterwards judges against that level again
    assert scan((x, None) for x in spike_after)[-1].skip


def test_warm_up_needs_min_history_and_non_finite_values_are_neither_judged_nor_learned():
    rule = SkipRule(min_history=32)
    assert not any(rule.decide(x).skip for x in [3.0] * 31 + [30.0])  # 31 accepted: not yet
    before = rule.state_dict()
    assert not rule.decide(float("nan"), float("inf")).skip
    assert rule.state_dict() == before


def test_state_round_trip_gives_the_same_decisions():
    losses = _noisy(400, seed=5)
    for i in (120, 260, 261, 330):
        losses[i] *= 1.3
    first = SkipRule()
    for x in losses[:200]:
        first.decide(x, 1.0)
    second = SkipRule()
    second.load_state_dict(first.state_dict())
    assert [first.decide(x, 1.0) for x in losses[200:]] == [second.decide(x, 1.0) for x in losses[200:]]


def test_settings_that_cannot_work_are_refused_with_the_reason():
    with pytest.raises(pydantic.ValidationError, match="skip_min_history"):
        GuardConfig(skip_window=16, skip_min_history=32)
    with pytest.raises(ValueError, match="min_history"):
        SkipRule(window=8, min_history=16)


def _poisoned_run(tmp_path, runtime=None, bus=None, poison_at=(70,)):
    tiny = Tiny(seed=2, noise=0.5)
    if runtime is not None:
        bus = runtime.bus
    guard = Guard(tiny.model, tiny.optimizer, run_id="poison", bus=bus,
                  topics=runtime.topics if runtime is not None else None,
                  config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False, data_seed=2,
                                     lockstep=runtime is not None))
    seen = {}
    for x, y in guard.data(tiny.loader, epochs=3, max_steps=100):
        step = guard.step_count
        if step in poison_at:
            x = x * 8.0  # a bad batch: the loss jumps far above the run's noise
        before = [p.detach().clone() for p in tiny.model.parameters()]
        applied = guard.step(tiny.loss((x, y)))
        seen[step] = (applied, all(torch.equal(a, b) for a, b in zip(before, tiny.model.parameters())))
    guard.close()
    return guard, seen


def test_a_poisoned_batch_is_skipped_at_once_without_rollback_under_the_full_pipeline(tmp_path):
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    runtime = open_runtime(load_settings({}, env={}))
    try:
        guard, seen = _poisoned_run(tmp_path, runtime=runtime)
        events = [decode(r.value, StepEvent) for r in runtime.bus.read_all(runtime.topics.steps)]
    finally:
        runtime.close()
    assert seen[70] == (False, True)  # not applied, parameters untouched, at the step itself
    assert all(applied for step, (applied, _) in seen.items() if step != 70)
    assert guard.counters["outlier_skips"] == guard.counters["skipped_updates"] == 1
    assert guard.counters["rollbacks"] == 0 and guard.step_count == 100
    by_step = {e.step: e for e in events}
    assert by_step[70].update_skipped and by_step[70].skip_reason == "outlier_step"
    assert by_step[70].loss > 3 * by_step[69].loss
    assert [e.step for e in events if e.update_skipped] == [70]
    # offline, the same rule on the published (loss, grad_norm) gives the same answer
    offline = scan((e.loss, e.grad_norm) for e in sorted(events, key=lambda e: e.step))
    assert [i for i, d in enumerate(offline) if d.skip] == [70]
