"""The Guard's local skips, found offline: the same rule and settings as the live Guard, one rule per run."""

from __future__ import annotations

import math

from spikeguard.lab.local_skips import LocalSkips, skip_rule_of
from spikeguard.producers.config import GuardConfig
from spikeguard.schemas import StepEvent


def flat(run_id: str = "r", steps: int = 300) -> list[StepEvent]:
    return [StepEvent(run_id=run_id, step=s, loss=1.0 + 0.01 * math.sin(s)) for s in range(steps)]


def test_an_isolated_outlier_is_skipped_with_the_guards_settings():
    events = flat()
    events[200] = events[200].model_copy(update={"loss": 3.0})
    skips, off = LocalSkips(), LocalSkips(GuardConfig(skip_outliers=False))
    assert [e.step for e in events if skips.observe(e)] == [200]
    assert not any(off.observe(e) for e in events) and off.skipped == []


def test_each_run_has_its_own_rule():
    a, b = flat("a"), flat("b")
    b = [
        e.model_copy(update={"loss": 10 * e.loss}) for e in b
    ]  # another level: not an outlier of run a
    skips = LocalSkips()
    assert not any(skips.observe(e) for pair in zip(a, b) for e in pair)
    assert skips.skipped == []


def test_the_rule_is_the_guards():
    rule = skip_rule_of(GuardConfig(skip_max_run=5))
    assert rule.max_run == 5 and skip_rule_of(GuardConfig()).max_run == GuardConfig().skip_max_run
    assert skip_rule_of(GuardConfig(skip_outliers=False)) is None


def test_offline_the_policy_hears_of_the_guards_skip_as_the_live_pipeline_does():
    """An isolated x1000 loss with a x1000 gradient: the live Guard skips its update and says so
    in the step event, so the policy takes it as absorbed once the loss is back. Offline, the
    same: the backtest's events carry the skip the Guard's rule would have made."""
    from spikeguard.lab.false_actions import pipeline_false_actions

    events = [
        StepEvent(run_id="r", step=s, loss=1.0 + 0.01 * math.sin(s), grad_norm=1.0, time=0.0)
        for s in range(1500)
    ]
    events[1000] = events[1000].model_copy(update={"loss": 1000.0, "grad_norm": 1000.0})
    found = pipeline_false_actions([events])
    assert found.local_skips == 1
    assert (found.rollbacks, found.skipped_batches, found.lr_cuts) == (0, 0, 0), found
    skips = LocalSkips()
    live = [skips.live(e) for e in events]
    assert live[1000].update_skipped and live[1000].skip_reason == "outlier_step"
    assert sum(e.update_skipped for e in live) == 1


def test_offline_a_warm_restart_explains_the_loss_rise_as_it_does_live():
    """The live Guard hands its rule each step's LR (a recent rise of it explains a rise of the
    loss); offline the same steps must be judged with the LR the file records."""
    lr = [1e-4 if s < 400 else 1e-2 for s in range(600)]  # a warm restart at step 400
    loss = [
        (0.5 + 0.01 * math.sin(s)) * (1.0 if s < 400 else 1.0 + 0.5 * math.exp(-(s - 400) / 30))
        for s in range(600)
    ]
    events = [StepEvent(run_id="r", step=s, loss=loss[s], lr=lr[s]) for s in range(600)]
    live = skip_rule_of(GuardConfig())
    assert live is not None
    expected = [e.step for e in events if live.decide(e.loss, None, e.lr).skip]
    offline = LocalSkips()
    assert [e.step for e in events if offline.observe(e)] == expected
