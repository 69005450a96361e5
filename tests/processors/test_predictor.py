"""The ``predictor``: early warnings ahead of trouble, quiet on healthy runs, stalls, LR too high."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError

from spikeguard.processors.detectors.predictor import PredictorConfig, PredictorDetector
from spikeguard.schemas import AnomalyType, HealthLevel, StepEvent

T0 = 1500  # where trouble starts in the synthetic runs below

#: The predictor is off by default (docs/detection.md); these tests are about what it does when on.
ON = PredictorConfig(enabled=True)


def run(
    n: int = 2000,
    seed: int = 0,
    *,
    grad_climb: float = 0.0,
    update_climb: float = 0.0,
    oscillation: float = 0.0,
    lr_jump: float = 1.0,
    flat_from: int | None = None,
    climb_for: int | None = None,
) -> list[StepEvent]:
    """A healthy run (decaying loss, t noise, noisy grad and update norms) with optional trouble at T0.

    ``grad_climb`` / ``update_climb``: log growth per step of the grad norm / update norm from T0;
    ``oscillation``: growth factor per step of an alternating loss component from T0;
    ``lr_jump``: the LR is multiplied by this at T0; ``flat_from``: the loss stops improving there;
    ``climb_for``: the climbs stop (and stay at their level) after this many steps.
    """
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    level = 2.5 + 3.0 * np.exp(-t / 300)
    if flat_from is not None:
        level[flat_from:] = level[flat_from]
    loss = level + 0.03 * rng.standard_t(6, n)
    log_grad = np.log(0.5) + 0.08 * rng.standard_normal(n)
    log_update = np.log(0.01) + 0.02 * rng.standard_normal(n)
    lr = np.full(n, 1e-3)
    after = np.clip(t - T0, 0, climb_for)
    log_grad += grad_climb * after
    log_update += update_climb * after
    if oscillation:
        loss += (t >= T0) * 0.01 * oscillation**after * (-1.0) ** t
    lr[T0:] *= lr_jump
    return [
        StepEvent(
            run_id="p",
            step=i,
            time=float(i),
            loss=float(loss[i]),
            grad_norm=float(math.exp(log_grad[i])),
            lr=float(lr[i]),
            update_norm=float(math.exp(log_update[i]) * lr[i] / 1e-3),
            param_norm=1.0,
        )
        for i in range(n)
    ]


def warnings(verdicts, kind: AnomalyType) -> list[int]:
    return [v.step for v in verdicts if v.is_anomaly and v.type is kind]


def test_every_verdict_carries_probability_horizon_and_health() -> None:
    config = PredictorConfig(enabled=True, horizon_steps=30)
    verdicts = PredictorDetector(config).update_many(run(400))
    assert len(verdicts) == 400
    for v in verdicts:
        assert v.detector == "predictor" and 0.0 <= v.instability_probability <= 1.0
        assert v.horizon_steps == 30 and v.health is not None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quiet_on_a_healthy_run(seed: int) -> None:
    verdicts = PredictorDetector(ON).update_many(run(3000, seed))
    assert not any(v.is_anomaly for v in verdicts)
    healthy = [v.health for v in verdicts[100:]]
    assert healthy.count(HealthLevel.EXCELLENT) / len(healthy) > 0.95


def test_warns_several_steps_before_a_grad_norm_runaway() -> None:
    # The grad norm grows 3 % a step from T0; say it blows up ~60 steps later.
    verdicts = PredictorDetector(ON).update_many(run(T0 + 60, grad_climb=0.03))
    warned = warnings(verdicts, AnomalyType.INSTABILITY_WARNING)
    assert warned and T0 < warned[0] <= T0 + 50  # at least 10 steps of lead
    v = verdicts[warned[0]]
    assert v.instability_probability >= 0.7 and v.health in (
        HealthLevel.CONCERNING,
        HealthLevel.CRITICAL,
    )
    assert v.signals["grad_trend"] > 2.5
    assert verdicts[T0 - 1].health is HealthLevel.EXCELLENT


def test_warns_on_growing_updates() -> None:
    verdicts = PredictorDetector(ON).update_many(run(T0 + 60, update_climb=0.02))
    warned = warnings(verdicts, AnomalyType.INSTABILITY_WARNING)
    assert warned and T0 < warned[0] <= T0 + 40
    assert verdicts[warned[0]].signals["update_trend"] > 1.0


def test_warns_before_a_growing_oscillation_gets_big() -> None:
    verdicts = PredictorDetector(ON).update_many(run(T0 + 80, oscillation=1.06))
    warned = warnings(verdicts, AnomalyType.INSTABILITY_WARNING)
    # amplitude 0.01 * 1.06**k passes 8 noise s.d. (0.24) at k ~ 55
    assert warned and T0 < warned[0] < T0 + 50
    assert verdicts[warned[0]].signals["oscillation"] > 0.45


def test_warning_is_one_episode_not_a_flicker() -> None:
    verdicts = PredictorDetector(ON).update_many(run(T0 + 80, grad_climb=0.03))
    flags = [v.is_anomaly for v in verdicts]
    starts = sum(1 for a, b in zip([False] + flags, flags) if b and not a)
    assert starts == 1


@pytest.mark.heavy
def test_stall_is_reported_once_per_stall_steps() -> None:
    config = PredictorConfig(enabled=True, stall_steps=500)
    verdicts = PredictorDetector(config).update_many(run(3000, flat_from=1000))
    stalled = warnings(verdicts, AnomalyType.STALLED)
    assert 1 <= len(stalled) <= 4 and stalled[0] >= 1000
    assert all(b - a >= 500 for a, b in zip(stalled, stalled[1:]))
    assert all(verdicts[s].health is HealthLevel.WARNING for s in stalled)
    improving = PredictorDetector(config).update_many(run(3000))
    assert not warnings(improving[:1000], AnomalyType.STALLED)


def test_lr_jump_is_lr_too_high_but_warmup_is_not() -> None:
    verdicts = PredictorDetector(ON).update_many(run(T0 + 20, lr_jump=4.0))
    assert warnings(verdicts, AnomalyType.LR_TOO_HIGH) == [T0]
    assert "lr_jump" in verdicts[T0].rules and verdicts[T0].confidence >= 0.7
    warm = [e.model_copy(update={"lr": 1e-3 * min(1.0, (e.step + 1) / 500)}) for e in run(1000)]
    assert not any(v.is_anomaly for v in PredictorDetector(ON).update_many(warm))
    blind = PredictorDetector(PredictorConfig(enabled=True, lr_jump_factor=math.inf))
    off = blind.update_many(run(T0 + 20, lr_jump=4.0))
    assert not warnings(off, AnomalyType.LR_TOO_HIGH)


def test_restoring_a_cut_lr_is_not_a_jump() -> None:
    # The policy halved the LR at 1200 and restores it (x2 in one step) at T0: a rate already seen.
    events = [
        e.model_copy(update={"lr": e.lr / 2, "update_norm": e.update_norm / 2})
        if 1200 <= e.step < T0
        else e
        for e in run(T0 + 50)
    ]
    assert not any(v.is_anomaly for v in PredictorDetector(ON).update_many(events))


def test_lr_too_high_for_the_gradient_scale() -> None:
    # LR and grad norm both rise while the loss starts to alternate: effective step x10.
    events = run(T0 + 80, grad_climb=0.02, oscillation=1.05)
    events = [
        e.model_copy(update={"lr": e.lr * math.exp(0.03 * max(0, e.step - T0))}) for e in events
    ]
    verdicts = PredictorDetector(
        PredictorConfig(enabled=True, lr_jump_factor=math.inf)
    ).update_many(events)
    flagged = warnings(verdicts, AnomalyType.LR_TOO_HIGH)
    assert flagged and flagged[0] > T0
    assert "lr_too_high" in verdicts[flagged[0]].rules
    assert verdicts[flagged[0]].signals["step_growth"] >= math.log(3.0)


def test_non_finite_step_is_critical() -> None:
    det = PredictorDetector(ON)
    det.update_many(run(200))
    v = det.update(StepEvent(run_id="p", step=200, loss=math.nan, grad_norm=1.0))
    assert v.is_anomaly and v.type is AnomalyType.INSTABILITY_WARNING
    assert v.instability_probability == 1.0 and v.health is HealthLevel.CRITICAL


def test_restart_from_json_state_and_batches_give_identical_verdicts() -> None:
    # A climb that stops: the probability sinks back through the hysteresis band.
    events = run(T0 + 300, grad_climb=0.03, climb_for=45, lr_jump=2.0)
    one = PredictorDetector(ON)
    straight = [one.update(e) for e in events]
    assert warnings(straight, AnomalyType.LR_TOO_HIGH) == [T0]
    held = [
        s
        for s in warnings(straight, AnomalyType.INSTABILITY_WARNING)
        if straight[s].instability_probability < 0.7
    ]
    assert held, "the run should hold a warning by hysteresis alone"
    cut = held[0]  # the first verdict after the restart depends on the saved episode state
    first = PredictorDetector(ON)
    before = first.update_many(events[:cut])
    second = PredictorDetector(ON)
    second.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert before + second.update_many(events[cut:]) == straight


def test_state_is_small_and_bounded() -> None:
    short, long = PredictorDetector(ON), PredictorDetector(ON)
    short.update_many(run(500))
    long.update_many(run(3000))
    assert abs(len(json.dumps(short.state_dict())) - len(json.dumps(long.state_dict()))) < 50
    assert len(json.dumps(long.state_dict())) < 2000


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValidationError, match="health_bounds"):
        PredictorConfig(enabled=True, health_bounds=(0.5, 0.3, 0.7, 0.9))
    with pytest.raises(ValidationError, match="warn_probability"):
        PredictorConfig(enabled=True, warn_probability=1.5)
    with pytest.raises(ValidationError, match="stall_steps"):
        PredictorConfig(enabled=True, stall_steps=0)


def test_absurd_finite_values_do_not_break_it() -> None:
    events = run(800)
    for i, loss in ((5, 1e300), (12, -1e300), (500, 1e300)):
        events[i] = events[i].model_copy(update={"loss": loss})
    verdicts = PredictorDetector(ON).update_many(events)
    assert all(0.0 <= v.instability_probability <= 1.0 for v in verdicts)
    assert not any(v.is_anomaly for v in verdicts[600:])  # the run is judged normally again


# -- features peeked once per process (processors.features) ----------------------
def test_features_of_two_detectors_learning_in_batches_equal_their_own():
    from spikeguard.processors.detectors.ml import MLConfig, MLDetector
    from spikeguard.processors.features import RollingFeatures

    events = run(300, seed=3)
    # With its forest: without it the ML detector stops its features once ready (never read).
    ml, predictor = MLDetector(MLConfig(forest=True)), PredictorDetector(ON)
    for i in range(0, len(events), 50):  # ML first, as in the pipeline, in batches
        ml.update_many(events[i : i + 50])
        predictor.update_many(events[i : i + 50])
    # The ML detector computes a batch's rows on a copy and then learns in place (ml/detector.py); the
    # predictor shares peeked features by content key: either way each holds what learning every
    # step one by one gives.
    alone = RollingFeatures()
    for event in events:
        alone.update_event(event)
    assert json.dumps(alone.state_dict()) == json.dumps(predictor.state.features.state_dict())
    assert json.dumps(alone.state_dict()) == json.dumps(ml.state.features.state_dict())


def test_features_changed_in_place_are_not_mistaken_for_their_old_content():
    from spikeguard.processors.features import RollingFeatures

    events = run(60, seed=4)
    base = RollingFeatures()
    for event in events[:40]:
        base.update_event(event)
    twin = base.copy()
    probe = events[40]
    f, after = base.peek_event(probe)
    assert twin.peek_event(probe)[1] is after  # equal content: shared
    for changed in (
        lambda g: g.update_event(events[41]),
        lambda g: g.restart(),
        lambda g: g.load_state_dict(RollingFeatures().state_dict()),
    ):
        g = base.copy()
        changed(g)
        expected = g.copy()  # what peeking g must give: its own content, learnt afresh
        got, g_after = g.peek_event(probe)
        assert g_after is not after
        want = expected.update_event(probe)
        assert json.dumps(g_after.state_dict()) == json.dumps(expected.state_dict())
        assert (got is None) == (want is None) and (got is None or tuple(got) == tuple(want))
    assert base.peek_event(probe) == (f, after)  # the original's entry still holds


def _mixed_events() -> list[StepEvent]:
    """Oscillation, non-finite steps, then a rollback re-running steps."""
    from spikeguard.lab.simulate import generate

    first = generate("oscillation", 900, seed=3, run_id="m").events
    events = [
        e.model_copy(update={"loss": math.nan})
        if e.step in (300, 301, 640)
        else e.model_copy(update={"grad_norm": math.inf})
        if e.step == 420
        else e
        for e in first[:700]
    ]
    rerun = generate("gradual_spike", 400, seed=5, run_id="m").events
    return events + [
        e.model_copy(update={"epoch": 1, "step": 450 + i}) for i, e in enumerate(rerun)
    ]


def _dump(verdicts) -> list[str]:
    return [v.model_dump_json() for v in verdicts]


def test_update_many_is_update_step_by_step() -> None:
    """The batch path advances features in place: the verdicts and state are update()'s."""
    events = _mixed_events()
    assert any(not e.finite for e in events) and events[-1].epoch == 1
    one_by_one = PredictorDetector(ON)
    expected = _dump(one_by_one.update(e) for e in events)
    assert any('"is_anomaly":true' in v for v in expected)
    batched = PredictorDetector(ON)
    got = []
    for start in range(0, len(events), 128):
        got += batched.update_many(events[start : start + 128])
    assert _dump(got) == expected
    assert json.dumps(batched.state_dict()) == json.dumps(one_by_one.state_dict())


def test_update_many_never_changes_features_it_shares() -> None:
    """Peeked features are shared between detectors of equal content: a batch copies before changing."""
    events = _mixed_events()[:400]
    a, b, alone = PredictorDetector(ON), PredictorDetector(ON), PredictorDetector(ON)
    for e in events[:100]:  # same content, same events: b adopts the very objects a adopted
        a.update(e)
        b.update(e)
        alone.update(e)
    assert a.state.features is b.state.features
    a.update_many(events[100:])
    assert _dump(b.update_many(events[100:])) == _dump(alone.update(e) for e in events[100:])
