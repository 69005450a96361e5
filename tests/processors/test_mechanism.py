"""The mechanism signals' bars: relative to the run's own level, silent on a healthy warm-up."""

from __future__ import annotations

import json
import math

from spikeguard.processors.detectors.mechanism import MechanismConfig, MechanismRules, RelativeBar
from spikeguard.processors.detectors.rules import RulesDetector
from spikeguard.schemas import AnomalyType, StepEvent


def _steps(values, update_ratio=None):
    return [
        StepEvent(
            run_id="r",
            step=i,
            loss=2.0 - 0.001 * i,
            grad_norm=1.0,
            time=float(i),
            attention_logit_max=v,
            update_ratio=update_ratio,
        )
        for i, v in enumerate(values)
    ]


def _healthy_logits(n=400):
    # The recovery benchmark's clean run: 0.13 at step 0, a hundredfold by step 50, then a
    # plateau near 16 with noise.
    return [min(16.0, 0.13 * math.exp(i / 10.3)) + (1.0 if i % 7 == 0 else 0.0) for i in range(n)]


def test_a_healthy_warm_up_and_plateau_never_fire():
    rules = RulesDetector()
    verdicts = [rules.update(e) for e in _steps(_healthy_logits())]
    assert not any(v.is_anomaly for v in verdicts)


def test_runaway_logits_fire_early_and_keep_firing_while_they_stay_up():
    # The benchmark's instability fault (seed 0): the logits measured at steps 0, 10, 20, 30
    # and 50, geometrically in between.
    anchors = [(0, 0.13), (10, 31.5), (20, 165.0), (30, 445.0), (50, 972.0), (60, 1500.0)]
    values = [
        a * (b / a) ** ((i - s) / (t - s))
        for (s, a), (t, b) in zip(anchors, anchors[1:])
        for i in range(s, t)
    ]
    rules = RulesDetector()
    verdicts = [rules.update(e) for e in _steps(values)]
    fired = [v.step for v in verdicts if v.is_anomaly]
    assert fired and fired[0] <= 20 and fired == list(range(fired[0], 60))
    first = verdicts[fired[0]]
    assert first.type is AnomalyType.ATTENTION_LOGIT_GROWTH and not first.critical
    assert first.rules == ["attention_logit_growth"]
    assert first.signals["attention_logit_growth_bar"] == 90.0  # 3 x the floor 30: no level yet
    assert first.signals["attention_logit_growth"] > 90.0


def test_the_bar_follows_the_run_s_own_level():
    # A run whose logits settle at 40 (wider heads): judged against 3 x 40, not 3 x 30.
    bar = RelativeBar(3.0, 30.0, 100)
    level = bar.fresh()
    for _ in range(100):
        assert bar.judge(40.0, level) is None
        bar.learn(40.0, level)
    assert bar.judge(110.0, level) is None
    assert bar.judge(130.0, level) == (130.0, 120.0)
    assert bar.judge(math.nan, level) is not None  # a non-finite logit always passes


def test_a_flagged_value_does_not_teach_the_level_and_loss_references_still_learn():
    rules = RulesDetector()
    events = _steps([10.0] * 20 + [500.0] * 50)
    for e in events:
        rules.update(e)
    assert rules.state.mechanism is not None
    assert rules.state.mechanism.attention.get() == 10.0  # the runaway never became normal
    assert len(rules.state.loss) == 70  # a mechanism-only verdict protects nothing else


def test_steps_without_signals_are_judged_as_before():
    plain = [StepEvent(run_id="r", step=i, loss=2.0, grad_norm=1.0, time=0.0) for i in range(50)]
    with_signals, without = RulesDetector(), RulesDetector()
    for e in plain:
        assert without.update(e).rules == []
    assert without.state.mechanism is None  # no level kept for a run without signals
    for e in _steps([10.0] * 50):
        with_signals.update(e)
    assert with_signals.state.mechanism is not None
    assert len(with_signals.state.mechanism.attention) == 50


def test_the_update_ratio_rule_is_off_by_default_and_fires_when_switched_on():
    events = _steps([10.0] * 40, update_ratio=0.2)
    assert not any(RulesDetector().update(e).is_anomaly for e in events)
    config = MechanismConfig(update_ratio_growth=3.0)
    from spikeguard.processors.detectors.rules import RulesConfig

    on = RulesDetector(RulesConfig(mechanism=config))
    verdict = on.update(events[0])
    assert verdict.type is AnomalyType.LR_TOO_HIGH and verdict.rules == ["update_ratio_high"]


def test_the_levels_round_trip_through_the_detector_state_exactly():
    rules = RulesDetector()
    for e in _steps(_healthy_logits(150)):
        rules.update(e)
    saved = json.loads(json.dumps(rules.state_dict()))
    twin = RulesDetector()
    twin.load_state_dict(saved)
    assert json.dumps(twin.state_dict()) == json.dumps(rules.state_dict())
    old = {k: v for k, v in saved.items() if k != "mechanism"}  # saved before the signals
    RulesDetector().load_state_dict(old)


def test_the_rules_are_pure_functions_of_event_and_levels():
    rules = MechanismRules(MechanismConfig())
    levels = rules.fresh()
    event = _steps([100.0])[0]
    assert (
        rules.judge(event, levels)
        == rules.judge(event, levels)
        == {"attention_logit_growth": (100.0, 90.0)}
    )
