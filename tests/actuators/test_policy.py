"""The recovery policy as a table: decision streams in, actions out."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from spikeguard.actuators import PolicyConfig, RecoveryPolicy
from spikeguard.actuators.policy import ForeignRunError
from spikeguard.errors import ConfigError
from spikeguard.processors.decision_table import CRITICAL_TYPES
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    AnomalyType as T,
    CheckpointEvent,
    Decision,
    Evidence,
    action_id,
    decision_id,
    incident_id,
)

R = "run-1"
K = ActionKind
CKPTS = (100, 200, 300, 400)
EXTRA = PolicyConfig().skip_extra_batches  # the margin skipped past an anomalous window


# --- helpers -------------------------------------------------------------------------------------
def dec(
    step: int,
    kind: T | None = None,
    *,
    onset: int | None = None,
    preventive: bool = False,
    with_incident: bool = True,
    loss: float | None = None,
) -> Decision:
    # a loss, when given, next to a baseline of 1.0 (the damage test reads them)
    evidence = None if loss is None else Evidence(step=step, loss=loss, loss_baseline=1.0)
    if kind is None:
        return Decision(decision_id=decision_id(R, step), run_id=R, step=step, is_anomaly=False)
    if preventive:
        return Decision(
            decision_id=decision_id(R, step),
            run_id=R,
            step=step,
            is_anomaly=True,
            type=kind,
            preventive=True,
            confidence=0.6,
        )
    onset = step if onset is None else onset
    return Decision(
        decision_id=decision_id(R, step),
        run_id=R,
        step=step,
        is_anomaly=True,
        type=kind,
        confidence=0.9,
        critical=kind in CRITICAL_TYPES,  # as fusion marks them
        incident_id=incident_id(R, onset) if with_incident else None,
        incident_onset_step=onset if with_incident else None,
        evidence=evidence,
    )


def ckpt(step: int, healthy: bool = True) -> CheckpointEvent:
    return CheckpointEvent(run_id=R, step=step, checkpoint_id=f"ck-{step}", healthy=healthy)


def ack(
    action: Action,
    status: AckStatus = AckStatus.APPLIED,
    step: int | None = None,
    rank: int = 0,
    result: str = "",
) -> Ack:
    return Ack(
        run_id=R,
        action_id=action.action_id,
        kind=action.kind,
        status=status,
        rank=rank,
        step=action.apply_at_step if step is None else step,
        result=result,
    )


# The rollback machinery (epochs, acks, escalation, bounds) is exercised with a trigger that
# rolls back at once: a critical non-finite decision from a loop that does not skip such
# updates itself. The default answers (the Guard skips them) are in test_responses.py.
MACHINERY = {"non_finite_skipped_by_trainer": False}


def make(ckpts=CKPTS, **config: Any) -> RecoveryPolicy:
    policy = RecoveryPolicy(PolicyConfig(**{**MACHINERY, **config}), run_id=R)
    for step in ckpts:
        assert policy.on_checkpoint(ckpt(step)) == []
    return policy


def healthy(policy: RecoveryPolicy, start: int, end: int) -> list[Action]:
    """Healthy decisions for steps start..end-1; every action they caused."""
    out: list[Action] = []
    for step in range(start, end):
        out += policy.on_decision(dec(step))
    return out


def summary(actions: list[Action]) -> list[tuple[str, dict]]:
    return [(a.kind.value, dict(a.params)) for a in actions]


def kinds(actions: list[Action]) -> list[ActionKind]:
    return [a.kind for a in actions]


def same(actual: list[tuple[str, dict]], expected: list[tuple[ActionKind, dict]]) -> bool:
    if [k for k, _ in actual] != [k.value for k, _ in expected]:
        return False
    for (_, got), (_, want) in zip(actual, expected):
        for key, value in want.items():
            if isinstance(value, float) and got.get(key) != pytest.approx(value):
                return False
            if not isinstance(value, float) and got.get(key) != value:
                return False
    return True


# --- the strategy table -------------------------------------------------------------------------------
# Each row: (config, script, expected). Script items: (step, type or None, onset); steps 401..first-1
# are healthy first. Expected: step -> actions (kind, params subset); unlisted steps produce nothing.
def _rows() -> list:
    def roll(t, s, cid=None):
        return K.ROLLBACK, {"target_step": t, "checkpoint_id": cid or f"ck-{t}"}

    def skip(a: int, b: int, extra: int = EXTRA) -> tuple[ActionKind, dict]:
        return K.SKIP_BATCHES, {"from_step": a, "to_step": b, "extra": extra}

    scale = lambda f: (K.SCALE_LR, {"factor": f})  # noqa: E731
    clip = lambda n: (K.CLIP, {"max_norm": n})  # noqa: E731
    # a divergence whose loss is three times its level: damaged (a rollback needs that)
    div = [(s, T.DIVERGENCE, 500, 3.0) for s in range(500, 576)]
    return [
        pytest.param(
            {},
            [(500, T.NON_FINITE, 500)],
            {500: [roll(400, 500), skip(500, 500), scale(0.5), clip(1.0)]},
            id="critical-non-finite",
        ),
        pytest.param(
            {},
            [(s, T.EXTREME_LOSS, 450) for s in range(500, 504)],
            {503: [roll(300, 503), skip(450, 503), scale(0.5), clip(1.0)]},
            id="critical-extreme-loss-judged-after-patience-target-before-onset",
        ),
        pytest.param(
            {},
            [(500, T.EXTREME_LOSS, 500), (501, None, 0), (502, None, 0), (503, None, 0)],
            {503: [roll(400, 503), skip(500, 503), scale(0.5), clip(1.0)]},
            id="critical-extreme-loss-without-evidence-of-absorption-rolls-back",
        ),
        pytest.param(
            {},
            [(500, T.NON_FINITE, 500), (501, T.NON_FINITE, 500), (502, T.NON_FINITE, 500)],
            {500: [roll(400, 500), skip(500, 500), scale(0.5), clip(1.0)]},
            id="critical-acts-once",
        ),
        pytest.param(
            {},
            [(500, T.GRADIENT_EXPLOSION, 500), (501, T.GRADIENT_EXPLOSION, 500), (502, None, 0)],
            {500: [scale(0.4), clip(1.0)]},
            id="explosion-lr-and-clip",
        ),
        pytest.param(
            {},
            [
                (500, T.GRADIENT_EXPLOSION, 500),
                (501, T.GRADIENT_EXPLOSION, 500),
                (502, T.LOSS_SPIKE, 500),
            ],
            {
                500: [scale(0.4), clip(1.0)],
                502: [roll(400, 502), skip(500, 502), scale(0.4), clip(0.5)],
            },
            id="explosion-then-loss-rolls-back",
        ),
        pytest.param(
            {"rollback_restores_lr": False},
            [(500, T.GRADIENT_EXPLOSION, 500), (502, T.LOSS_SPIKE, 500)],
            {500: [scale(0.4), clip(1.0)], 502: [roll(400, 502), skip(500, 502), clip(0.5)]},
            id="explosion-then-loss-guard-keeps-lr",
        ),
        pytest.param(
            {},
            [(500, T.LOSS_SPIKE, 500), (501, T.GRADIENT_EXPLOSION, 500)],
            {501: [roll(400, 501), skip(500, 501), scale(0.4), clip(1.0)]},
            id="explosion-with-loss-already-following",
        ),
        pytest.param(
            {},
            [(s, T.LOSS_SPIKE, 500) for s in range(500, 504)],
            {503: [(K.ALERT, {"severity": "warning"})]},
            id="spike-flat-without-sign-of-damage-is-watched",
        ),
        pytest.param(
            {"flat_rise_waits": False},
            [(s, T.LOSS_SPIKE, 500) for s in range(500, 504)],
            {503: [roll(400, 503), skip(500, 503)]},
            id="spike-not-recovering-data-lr-stays",
        ),
        pytest.param(
            {"lr_decrease_factor_spike": 0.5, "flat_rise_waits": False},
            [(s, T.LOSS_SPIKE, 500) for s in range(500, 504)],
            {503: [roll(400, 503), skip(500, 503), scale(0.5)]},
            id="spike-lr-cut-is-a-setting",
        ),
        pytest.param(
            {},
            [(500, T.LOSS_SPIKE, 500), (501, None, 0), (502, None, 0), (503, None, 0)],
            {503: [(K.CHECKPOINT, {"reason": "on_demand"}), (K.ALERT, {"severity": "info"})]},
            id="spike-recovering-watch-only",
        ),
        pytest.param(
            {"spike_patience_steps": 5, "flat_rise_waits": False},
            [(500, T.LOSS_SPIKE, 500)] + [(s, T.LOSS_SPIKE, 500) for s in range(501, 506)],
            {505: [roll(400, 505), skip(500, 505)]},
            id="spike-patience-is-a-setting",
        ),
        pytest.param(
            {},
            [
                (500, T.LOSS_SPIKE, 500),
                (501, T.NON_FINITE, 500),
                (502, T.NON_FINITE, 500),
                (503, T.NON_FINITE, 500),
            ],
            {501: [roll(400, 501), skip(500, 501), scale(0.5), clip(1.0)]},
            id="spike-turning-critical-acts-at-once",
        ),
        pytest.param(
            {},
            div,
            {
                500: [(K.CHECKPOINT, {"reason": "emergency"}), scale(0.8)],
                525: [scale(0.8)],
                550: [scale(0.8)],
                575: [roll(400, 575), skip(500, 575), scale(0.512)],
            },
            id="divergence-lr-steps-then-rollback",
        ),
        pytest.param(
            {"rollback_restores_lr": False},
            div,
            {
                500: [(K.CHECKPOINT, {"reason": "emergency"}), scale(0.8)],
                525: [scale(0.8)],
                550: [scale(0.8)],
                575: [roll(400, 575), skip(500, 575)],
            },
            id="divergence-guard-keeps-lr",
        ),
        pytest.param(
            {},
            [(s, T.DIVERGENCE, 500, 1.2) for s in range(500, 600)],
            {
                500: [(K.CHECKPOINT, {"reason": "emergency"}), scale(0.8)],
                525: [scale(0.8)],
                550: [scale(0.8)],
                575: [(K.ALERT, {"severity": "warning"})],
            },
            id="divergence-not-damaged-is-watched-after-its-lr-steps",
        ),
        pytest.param(
            {},
            [(500, T.OSCILLATION, 500), (510, T.OSCILLATION, 500)],
            {500: [(K.CHECKPOINT, {"reason": "emergency"}), scale(0.8)]},
            id="oscillation",
        ),
        pytest.param(
            {},
            [(500, T.ML_OUTLIER, 500), (501, T.ML_OUTLIER, 500)],
            {500: [(K.ALERT, {"severity": "warning"})]},
            id="other-types-alert-once",
        ),
        pytest.param(
            {},
            [(500, T.OUTLIER_STEP, 500), (501, None, 0), (600, T.OUTLIER_STEP, 600)],
            {500: [(K.ALERT, {"severity": "info"})], 600: [(K.ALERT, {"severity": "info"})]},
            id="outlier-step-is-said-never-recovered",
        ),
        pytest.param(
            {},
            [
                (500, T.LOSS_SPIKE, 500),
                (501, None, 0),
                (502, None, 0),
                (503, T.OUTLIER_STEP, 503),
                (504, None, 0),
            ],
            {
                503: [(K.ALERT, {"severity": "info"})],
                504: [(K.CHECKPOINT, {"reason": "on_demand"}), (K.ALERT, {"severity": "info"})],
            },
            id="outlier-step-is-not-a-spike-going-on",
        ),
        pytest.param(
            {},
            [(500, T.SLOW_RISE, 500), (510, T.SLOW_RISE, 500)],
            {500: [(K.CHECKPOINT, {"reason": "emergency"}), scale(0.8)]},
            id="slow-rise",
        ),
        pytest.param(
            {"apply_lag_steps": 0},
            [(500, T.NON_FINITE, 500)],
            {500: [roll(400, 500), skip(500, 500), scale(0.5), clip(1.0)]},
            id="lag-zero",
        ),
    ]


@pytest.mark.parametrize("config, script, expected", _rows())
def test_strategy_table(config: dict, script: list, expected: dict) -> None:
    policy = make(**config)
    assert healthy(policy, 401, script[0][0]) == []
    lag = policy.config.apply_lag_steps
    for step, kind, onset, *loss in script:
        actions = policy.on_decision(dec(step, kind, onset=onset, loss=loss[0] if loss else None))
        want = expected.get(step, [])
        assert same(summary(actions), want), (step, summary(actions), want)
        assert all(a.apply_at_step == step + lag for a in actions)
        assert all(
            a.run_id == R and a.decision_id == decision_id(R, step) and a.reason for a in actions
        )


# --- missing checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ckpts, unhealthy",
    [((), ()), ((450,), ()), ((450,), (300, 350))],
    ids=["none", "too-close-to-onset", "only-unhealthy-eligible"],
)
def test_no_eligible_checkpoint_falls_back(ckpts: tuple, unhealthy: tuple) -> None:
    policy = make(ckpts=ckpts, rollback_min_steps_before_onset=100)
    for step in unhealthy:
        policy.on_checkpoint(ckpt(step, healthy=False))
    actions = policy.on_decision(dec(500, T.NON_FINITE))
    assert kinds(actions) == [K.SCALE_LR, K.SKIP_BATCHES, K.CLIP, K.ALERT]
    assert dict(actions[0].params) == {"factor": 0.5}
    assert dict(actions[1].params) == {
        "from_step": 500,
        "to_step": 500,
        "extra": PolicyConfig().skip_extra_batches,
    }
    assert "ahead" in actions[1].reason and "no healthy checkpoint" in actions[1].reason
    assert "no healthy checkpoint" in actions[3].params["message"]
    assert not any(a.kind is K.ROLLBACK for a in actions)


def test_fallback_counts_as_the_incident_recovery() -> None:
    policy = make(ckpts=())
    first = policy.on_decision(dec(500, T.NON_FINITE))
    assert K.SKIP_BATCHES in kinds(first)
    policy.on_ack(ack(first[0]))  # applied at step 501: the steps after it judge it
    # Within the grace window the same incident triggers nothing; still failing after it stops the run.
    quiet = [policy.on_decision(dec(s, T.NON_FINITE, onset=500)) for s in range(501, 505)]
    assert quiet == [[]] * 4
    stop = policy.on_decision(dec(505, T.NON_FINITE, onset=500))
    assert kinds(stop) == [K.CHECKPOINT, K.STOP, K.ALERT]


# --- escalation ----------------------------------------------------------------------------------------------
def _rollback(policy: RecoveryPolicy, step: int, onset: int | None = None) -> Action:
    actions = policy.on_decision(dec(step, T.NON_FINITE, onset=onset))
    assert actions and actions[0].kind is K.ROLLBACK, summary(actions)
    assert policy.on_ack(ack(actions[0])) == []
    return actions[0]


def test_second_rollback_for_the_same_incident_stops_the_run() -> None:
    policy = make()
    healthy(policy, 401, 500)
    rollback = _rollback(policy, 500)
    assert rollback.params["target_step"] == 400
    healthy(policy, 401, 500)  # the re-run
    actions = policy.on_decision(dec(510, T.NON_FINITE, onset=500))  # same incident again
    assert summary(actions) == [
        ("checkpoint", {"reason": "emergency"}),
        ("stop", {"reason": actions[1].params["reason"]}),
        ("alert", {"severity": "critical", "message": actions[2].params["message"]}),
    ]
    assert "incident" in actions[1].params["reason"]
    assert policy.stopped
    # After STOP: nothing more, whatever comes in.
    assert policy.on_decision(dec(511, T.NON_FINITE, onset=511)) == []
    assert policy.on_decision(dec(512)) == []
    assert policy.on_ack(ack(actions[0], AckStatus.FAILED)) == []


@pytest.mark.parametrize("window, stops", [(1000, True), (50, False)])
def test_rollbacks_within_a_window_escalate(window: int, stops: bool) -> None:
    policy = make(
        ckpts=range(100, 1001, 100),
        rollback_window_steps=window,
        max_rollbacks_in_window=2,
        rollback_min_steps_before_onset=10,
    )
    healthy(policy, 1001, 1100)
    assert _rollback(policy, 1100).params["target_step"] == 1000
    healthy(policy, 1001, 1080)
    assert _rollback(policy, 1080).params["target_step"] == 1000
    healthy(policy, 1001, 1060)
    third = policy.on_decision(dec(1060, T.NON_FINITE))
    if stops:
        assert kinds(third) == [K.CHECKPOINT, K.STOP, K.ALERT]
        assert "2 rollbacks within the last 1000 steps" in third[1].params["reason"]
    else:
        assert kinds(third)[0] is K.ROLLBACK


# --- bounds and LR restore -------------------------------------------------------------------------------------
def test_lr_and_clip_stay_within_bounds() -> None:
    policy = make(min_lr_factor=0.05, min_clip_norm=0.1)
    factor, norms = 1.0, []
    for i in range(12):  # twelve separate explosions, too close together for any restore
        step = 500 + 10 * i
        for a in policy.on_decision(dec(step, T.GRADIENT_EXPLOSION)):
            if a.kind is K.SCALE_LR:
                assert 0 < a.params["factor"] < 1
                factor *= a.params["factor"]
            if a.kind is K.CLIP:
                norms.append(a.params["max_norm"])
        healthy(policy, step + 1, step + 10)
        assert factor >= 0.05 - 1e-12
    assert factor == pytest.approx(0.05)
    assert policy.recovery.lr.current == pytest.approx(0.05)
    assert min(norms) == pytest.approx(0.1) and norms == sorted(norms, reverse=True)


def test_lr_restored_gradually_never_above_base() -> None:
    policy = make()
    assert summary(policy.on_decision(dec(500, T.GRADIENT_EXPLOSION)))[0] == (
        "scale_lr",
        {"factor": 0.4},
    )
    restores = [a for a in healthy(policy, 501, 2000) if a.kind is K.RESTORE_LR]
    factors = [a.params["factor"] for a in restores]
    assert factors[:3] == [1.25, 1.25, 1.25] and all(1 < f <= 1.25 for f in factors)
    steps = [a.apply_at_step - 1 for a in restores]
    assert steps[0] == 700 and all(b - a == 200 for a, b in zip(steps, steps[1:]))
    total = 0.4
    for f in factors:
        total *= f
    assert total == pytest.approx(1.0)
    assert policy.recovery.lr.current == 1.0
    assert len(factors) == 5  # 0.4 -> 0.5 -> 0.625 -> 0.78 -> 0.98 -> 1.0, then nothing


def test_an_anomaly_restarts_the_healthy_count() -> None:
    policy = make()
    policy.on_decision(dec(500, T.GRADIENT_EXPLOSION))
    assert healthy(policy, 501, 650) == []
    policy.on_decision(dec(650, T.ML_OUTLIER))
    assert healthy(policy, 651, 850) == []
    assert kinds(policy.on_decision(dec(850))) == [K.RESTORE_LR]


# --- preventive warnings ----------------------------------------------------------------------------------------
def test_warnings_are_low_key_and_rate_limited() -> None:
    policy = make(preventive_min_interval_steps=100)
    healthy(policy, 401, 500)
    first = policy.on_decision(dec(500, T.INSTABILITY_WARNING, preventive=True))
    assert summary(first) == [("checkpoint", {"reason": "on_demand"}), ("clip", {"max_norm": 1.0})]
    assert healthy(policy, 501, 510) == []
    assert policy.on_decision(dec(510, T.LR_TOO_HIGH, preventive=True)) == []
    out = healthy(policy, 511, 600)
    assert out == []
    second = policy.on_decision(dec(600, T.LR_TOO_HIGH, preventive=True))
    assert summary(second) == [("checkpoint", {"reason": "on_demand"}), ("clip", {"max_norm": 0.5})]
    healthy(policy, 601, 700)
    third = policy.on_decision(dec(700, T.INSTABILITY_WARNING, preventive=True))
    assert kinds(third) == [
        K.CHECKPOINT
    ]  # clipping is not tightened below initial x factor by warnings
    healthy(policy, 701, 800)
    assert kinds(policy.on_decision(dec(800, T.STALLED, preventive=True))) == [
        K.CHECKPOINT,
        K.ALERT,
    ]
    everything = first + second + third
    assert not {K.ROLLBACK, K.SCALE_LR, K.SKIP_BATCHES, K.STOP} & set(kinds(everything))


# --- duplicates, late and out-of-order decisions ------------------------------------------------------------------
def test_duplicate_decisions_produce_nothing_new() -> None:
    policy = make()
    healthy(policy, 401, 500)
    trigger = dec(500, T.NON_FINITE)
    assert kinds(policy.on_decision(trigger))[0] is K.ROLLBACK
    assert policy.on_decision(trigger) == []
    assert policy.on_decision(dec(450)) == []
    assert policy.counts["duplicate"] == 2


def test_late_decisions_are_recorded_not_acted_on() -> None:
    policy = make()
    healthy(policy, 401, 500)
    assert policy.on_decision(dec(501)) == []  # 500 has not come yet
    assert policy.on_decision(dec(500, T.NON_FINITE)) == []  # older than one already handled
    assert policy.counts["late"] == 1
    # The next in-order decision carries the incident forward: one rollback, not two.
    actions = policy.on_decision(dec(502, T.NON_FINITE, onset=500))
    assert kinds(actions)[0] is K.ROLLBACK
    assert policy.on_decision(dec(500, T.NON_FINITE)) == []


def test_out_of_order_spike_does_not_contradict() -> None:
    policy = make()
    healthy(policy, 401, 500)
    policy.on_decision(dec(500, T.LOSS_SPIKE))
    for step in (501, 502, 503):
        out = policy.on_decision(dec(step))
    assert kinds(out) == [K.CHECKPOINT, K.ALERT]  # recovered: watch only
    # A late "still anomalous" decision for 502 must not turn the watch into a rollback.
    assert policy.on_decision(dec(502, T.LOSS_SPIKE, onset=500)) == []
    assert policy.on_decision(dec(504)) == []


def test_foreign_run_is_refused() -> None:
    policy = make()
    other = Decision(decision_id=decision_id("other", 1), run_id="other", step=1, is_anomaly=False)
    with pytest.raises(ForeignRunError):
        policy.on_decision(other)
    with pytest.raises(ConfigError):
        RecoveryPolicy()


# --- rollback epochs: the re-run after a rollback ------------------------------------------------------------------
def test_rerun_after_rollback_is_observed_anew() -> None:
    policy = make()
    healthy(policy, 401, 450)
    policy.on_decision(dec(450, T.LOSS_SPIKE))
    watch0 = healthy(policy, 451, 454)
    assert kinds(watch0) == [K.CHECKPOINT, K.ALERT]
    healthy(policy, 454, 500)
    rollback = policy.on_decision(dec(500, T.NON_FINITE))[0]
    assert rollback.params["target_step"] == 400
    # The trainer runs on until it applies the rollback: those decisions are ignored.
    assert [policy.on_decision(dec(s, T.NON_FINITE, onset=500)) for s in (501, 502)] == [[], []]
    # Re-run decisions arriving before the ack look like duplicates.
    assert policy.on_decision(dec(401)) == []
    assert policy.on_ack(ack(rollback, step=503)) == []
    assert policy.on_ack(ack(rollback, step=503, rank=1)) == []  # another rank: one epoch, not two
    assert policy.epoch == 1
    assert policy.on_decision(dec(503, T.NON_FINITE, onset=500)) == []  # abandoned timeline, late
    ticks = policy.observed_steps
    assert healthy(policy, 401, 450) == []
    assert policy.observed_steps == ticks + 49  # the re-run's steps count as new observations
    # The same spike in the re-run: same decisions, same kinds and params, different ids.
    policy.on_decision(dec(450, T.LOSS_SPIKE))
    watch1 = healthy(policy, 451, 454)
    assert summary(watch1) == summary(watch0)
    assert {a.action_id for a in watch1}.isdisjoint({a.action_id for a in watch0})
    assert watch1[0].action_id == action_id(f"{decision_id(R, 453)}@1", "checkpoint", 0)
    # Past the old incident step and beyond the abandoned steps, handled normally.
    assert healthy(policy, 454, 520) == []
    assert policy.observed_steps == ticks + 49 + 1 + 3 + 66


def test_only_an_applied_ack_opens_the_next_epoch() -> None:
    policy = make()
    rollback = policy.on_decision(dec(500, T.NON_FINITE))[0]
    # A redelivered copy still pending in the guard is acked DUPLICATE: not yet applied.
    assert policy.on_ack(ack(rollback, AckStatus.DUPLICATE, step=500)) == []
    assert policy.epoch == 0
    assert policy.on_ack(ack(rollback, AckStatus.APPLIED)) == []
    assert policy.epoch == 1 and policy.high_water == 400
    assert policy.on_ack(ack(rollback, AckStatus.DUPLICATE)) == [] and policy.epoch == 1


def test_checkpoints_of_the_abandoned_timeline_are_forgotten() -> None:
    policy = make(ckpts=(100, 200, 300, 400, 450), rollback_min_steps_before_onset=50)
    healthy(policy, 451, 500)
    rollback = policy.on_decision(dec(500, T.NON_FINITE))[0]
    assert rollback.params["target_step"] == 450
    policy.on_checkpoint(ckpt(505))  # written by the old timeline before the rollback applied
    policy.on_ack(ack(rollback, step=506))
    assert [c.step for c in policy.recovery.book.healthy] == [100, 200, 300, 400, 450]


# --- acks -------------------------------------------------------------------------------------------------------------
def test_failed_rollback_alerts_once_and_is_not_retried() -> None:
    policy = make()
    healthy(policy, 401, 500)
    rollback = policy.on_decision(dec(500, T.NON_FINITE))[0]
    policy.on_decision(dec(501, T.NON_FINITE, onset=500))
    alert = policy.on_ack(ack(rollback, AckStatus.FAILED, result="checkpoint file missing"))
    assert summary(alert) == [
        ("alert", {"severity": "critical", "message": alert[0].params["message"]})
    ]
    assert (
        "not retried" in alert[0].params["message"] and "file missing" in alert[0].params["message"]
    )
    assert policy.on_ack(ack(rollback, AckStatus.FAILED, rank=1)) == []
    assert "ck-400" not in [c.checkpoint_id for c in policy.recovery.book.healthy]
    assert policy.recovery.lr.current == pytest.approx(
        0.5
    )  # the SCALE_LR sent with it still applied
    # The incident goes on: quiet through the grace steps, then — no second rollback — a stop.
    outs = [policy.on_decision(dec(s, T.NON_FINITE, onset=500)) for s in range(502, 507)]
    assert outs[:4] == [[]] * 4
    assert kinds(outs[4]) == [K.CHECKPOINT, K.STOP, K.ALERT]


def test_rejected_rollback_alerts() -> None:
    policy = make()
    rollback = policy.on_decision(dec(500, T.NON_FINITE))[0]
    out = policy.on_ack(ack(rollback, AckStatus.REJECTED, result="bad signature"))
    assert kinds(out) == [K.ALERT] and out[0].params["severity"] == "critical"


def test_other_failed_actions_alert_once() -> None:
    policy = make()
    scale = policy.on_decision(dec(500, T.GRADIENT_EXPLOSION))[0]
    first = policy.on_ack(ack(scale, AckStatus.FAILED))
    assert kinds(first) == [K.ALERT] and first[0].params["severity"] == "warning"
    assert policy.on_ack(ack(scale, AckStatus.FAILED, rank=1)) == []
    assert policy.on_ack(ack(scale, AckStatus.APPLIED)) == []


def test_unacknowledged_rollback_times_out_with_an_alert() -> None:
    policy = make(rollback_ack_timeout_steps=20)
    policy.on_decision(dec(500, T.NON_FINITE))
    assert healthy(policy, 501, 521) == []
    out = policy.on_decision(dec(521))
    assert kinds(out) == [K.ALERT] and "not acknowledged" in out[0].params["message"]
    assert healthy(policy, 522, 530) == []
    assert policy.observed_steps > 0 and policy.high_water == 529


# --- determinism, state, bounded memory ---------------------------------------------------------------------
def _scenario(policy: RecoveryPolicy, snapshot_at: int | None = None) -> list[dict]:
    """A trainer-like run with most situations: acks at once, re-runs after rollbacks.

    Returns every action as JSON; with ``snapshot_at`` the policy is rebuilt from a JSON
    round trip of its state right after the first decision for that step.
    """
    schedule = {
        300: (T.GRADIENT_EXPLOSION, 300),
        301: (T.LOSS_SPIKE, 300),
        400: (T.LOSS_SPIKE, 400),
        450: (T.INSTABILITY_WARNING, None),
        520: (T.NON_FINITE, 520),
    }
    schedule.update({s: (T.DIVERGENCE, 700) for s in range(700, 760)})
    fired: set[int] = set()  # skipped data does not come back: an anomaly happens once
    out: list[Action] = []
    step, snapshotted = 1, False
    while step < 1200:
        if step % 50 == 0:
            out += policy.on_checkpoint(ckpt(step, healthy=not 300 <= step <= 330))
        kind, onset = schedule.get(step, (None, None)) if step not in fired else (None, None)
        actions = policy.on_decision(
            dec(step, kind, onset=onset, preventive=kind is T.INSTABILITY_WARNING)
        )
        out += actions
        if step == snapshot_at and not snapshotted:
            snapshotted = True
            state = json.loads(json.dumps(policy.state_dict()))
            policy = RecoveryPolicy(policy.config, run_id=R)
            policy.load_state_dict(state)
        rollback = next((a for a in actions if a.kind is K.ROLLBACK), None)
        if rollback is None:
            step += 1
            continue
        fired.update(s for s in schedule if s <= step)
        out += policy.on_decision(dec(step + 1))  # ran on until the rollback applied
        out += policy.on_ack(ack(rollback, step=step + 1))
        step = rollback.params["target_step"] + 1
    return [a.model_dump(mode="json") for a in out]


def test_replay_yields_identical_actions_and_ids() -> None:
    first = _scenario(make(ckpts=()))
    second = _scenario(make(ckpts=()))
    assert first == second
    assert len({a["action_id"] for a in first}) == len(first)  # no id collides
    assert [a["kind"] for a in first].count("rollback") == 2
    assert {"skip_batches", "scale_lr", "clip", "checkpoint", "restore_lr", "alert"} <= {
        a["kind"] for a in first
    }
    # Restoring from a snapshot (JSON round trip) midway changes nothing.
    for at in (301, 402, 521, 720, 900):
        assert _scenario(make(ckpts=()), snapshot_at=at) == first


def test_state_is_bounded() -> None:
    policy = make(ckpts=(), lr_restore_healthy_steps=50)
    for step in range(1, 20_001):
        if step % 50 == 0:
            policy.on_checkpoint(ckpt(step))
        kind = None
        if step % 300 == 0:
            kind = T.LOSS_SPIKE
        elif step % 1000 == 7:
            kind = T.GRADIENT_EXPLOSION
        elif step % 170 == 0:
            kind = T.ML_OUTLIER
        policy.on_decision(dec(step, kind))
    assert not policy.stopped
    assert len(policy.seen) <= policy.config.seen_window_steps + 1
    assert len(policy.incidents.incidents) <= policy.config.max_incidents
    assert len(policy.recovery.book.healthy) <= policy.config.max_checkpoints
    assert len(policy.recovery.lr.log) <= 64
    assert len(json.dumps(policy.state_dict())) < 100_000


def test_decisions_of_one_fusion_incident_share_its_recovery() -> None:
    """Fusion groups steps into incidents (once, with its incident_gap_steps); the policy follows."""
    policy = make()
    healthy(policy, 401, 500)
    first = policy.on_decision(dec(500, T.GRADIENT_EXPLOSION, onset=500))
    assert kinds(first) == [K.SCALE_LR, K.CLIP]
    assert policy.on_decision(dec(505, T.GRADIENT_EXPLOSION, onset=500)) == []  # same incident
    rolled = policy.on_decision(dec(510, T.LOSS_SPIKE, onset=500))  # loss follows: same incident
    assert kinds(rolled)[0] is K.ROLLBACK
    assert rolled[0].params["target_step"] == 400  # onset 500 of fusion's incident


def test_the_policy_answers_fusion_s_critical_flag() -> None:
    """Fusion decides criticality; the policy answers a critical decision at once, whatever its
    type, except a finite loss: that one is judged after the patience (it may be absorbed)."""
    policy = make()
    healthy(policy, 401, 500)
    assert (
        policy.on_decision(dec(500, T.BAD_BATCH)) == []
    )  # not critical: judged after the patience
    other = make()
    healthy(other, 401, 500)
    critical = dec(500, T.BAD_BATCH).model_copy(update={"critical": True})
    assert kinds(other.on_decision(critical)) == [K.ROLLBACK, K.SKIP_BATCHES, K.SCALE_LR, K.CLIP]
    loss = make()
    healthy(loss, 401, 500)
    assert loss.on_decision(dec(500, T.LOSS_SPIKE).model_copy(update={"critical": True})) == []


def test_a_decision_without_an_incident_is_an_incident_of_its_own() -> None:
    policy = make()
    healthy(policy, 401, 500)
    assert kinds(policy.on_decision(dec(500, T.GRADIENT_EXPLOSION, with_incident=False))) == [
        K.SCALE_LR,
        K.CLIP,
    ]
    # no regrouping in the policy: 505 is a new incident, so its explosion is answered again
    assert kinds(policy.on_decision(dec(505, T.GRADIENT_EXPLOSION, with_incident=False))) == [
        K.SCALE_LR,
        K.CLIP,
    ]
    assert not hasattr(policy.config, "incident_gap_steps")


# --- config -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, field",
    [
        ({"spike_types": (T.LOSS_SPIKE, T.NON_FINITE)}, "non_finite"),
        ({"clip_norm_initial": 50.0}, "clip_norm_initial"),
        ({"lr_decrease_factor_critical": 1.5}, "lr_decrease_factor_critical"),
        ({"lr_restore_factor": 0.9}, "lr_restore_factor"),
        ({"no_such_setting": 1}, "no_such_setting"),
    ],
)
def test_bad_config_names_the_field(bad: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        PolicyConfig(**bad)


def test_default_strategy_of_every_type() -> None:
    cfg = PolicyConfig()
    assert {t: cfg.strategy_of(t, critical=t in CRITICAL_TYPES) for t in T} == {
        T.NONE: "notice",
        T.NON_FINITE: "critical",
        T.EXTREME_LOSS: "critical",
        T.GRADIENT_EXPLOSION: "explosion",
        T.LOSS_SPIKE: "spike",
        T.DIVERGENCE: "slow",
        T.OSCILLATION: "slow",
        T.LR_OUT_OF_BOUNDS: "notice",
        T.LOSS_SCALE_COLLAPSE: "notice",
        T.BAD_BATCH: "spike",
        T.ML_OUTLIER: "notice",
        T.INSTABILITY_WARNING: "preventive",
        T.STALLED: "preventive",
        T.LR_TOO_HIGH: "preventive",
        T.SLOW_RISE: "slow",
        T.OUTLIER_STEP: "notice",  # the policy answers it before any strategy: one info ALERT
        T.LAYER_BLOWUP: "notice",  # the ml detector's layer view: one ALERT per incident
        T.LR_INDUCED_RISE: "notice",  # the policy answers it before any strategy: the LR scaled back
        T.ATTENTION_LOGIT_GROWTH: "notice",  # answered before any strategy: QK-clip and an LR cut
    }


def test_optional_knobs_stay_bounded() -> None:
    policy = make(
        eps_actions=True,
        batch_size_actions=True,
        max_eps=1e-6,
        min_batch_size_factor=0.5,
        max_rollbacks_in_window=10,
        rollback_min_steps_before_onset=10,
    )
    out = policy.on_decision(dec(500, T.NON_FINITE))
    assert kinds(out) == [
        K.ROLLBACK,
        K.SKIP_BATCHES,
        K.SCALE_LR,
        K.CLIP,
        K.REDUCE_BATCH_SIZE,
        K.SET_EPS,
    ]
    assert dict(out[4].params) == {"factor": 0.5} and out[5].params["eps"] == pytest.approx(1e-7)
    policy.on_ack(ack(out[0]))
    healthy(policy, 401, 450)
    again = policy.on_decision(dec(450, T.NON_FINITE))
    assert K.REDUCE_BATCH_SIZE not in kinds(again)  # at the floor
    assert [a.params["eps"] for a in again if a.kind is K.SET_EPS] == [pytest.approx(1e-6)]


def test_every_action_of_an_incident_names_its_onset_for_the_trainers_forensics() -> None:
    """The trainer writes the incident's record (sample ids, pre-onset checkpoint) around the onset
    fusion found, the one the report shows, not the decided step minus a guess."""
    from spikeguard.schemas.signing import canonical_payload, sign_action, verify_action

    policy = make()
    actions = policy.on_decision(dec(330, T.NON_FINITE, onset=310))
    assert actions and all(a.incident_onset_step == 310 for a in actions)
    assert all(verify_action(sign_action(a, "k"), "k") for a in actions)
    spike = make()  # an extreme loss's rollback is decided after its patience, on a healthy step
    later = spike.on_decision(dec(330, T.EXTREME_LOSS, onset=328)) + healthy(spike, 331, 340)
    (rollback,) = [a for a in later if a.kind is K.ROLLBACK]
    assert rollback.decision_id == decision_id(R, 333) and rollback.incident_onset_step == 328
    restore = Action(
        action_id="x", run_id=R, kind=K.RESTORE_LR, apply_at_step=9, params={"factor": 2}
    )
    assert b"incident_onset_step" not in canonical_payload(restore)  # signed only when set


def test_a_rollback_the_trainer_withheld_is_not_followed_by_a_promise_to_stop() -> None:
    """Observe mode (or the budget) withholds the rollback and would withhold a stop too: the
    alert says what happens instead of promising a stop that will not come."""
    from spikeguard.schemas import WITHHELD

    policy = make()
    rollback = policy.on_decision(dec(500, T.NON_FINITE))[0]
    (alert,) = policy.on_ack(ack(rollback, AckStatus.REJECTED, result=f"{WITHHELD}observe mode"))
    message = alert.params["message"]
    assert "withheld by the trainer (observe mode)" in message and "stops the run" not in message
    refused = make()
    rollback = refused.on_decision(dec(500, T.NON_FINITE))[0]
    (alert,) = refused.on_ack(ack(rollback, AckStatus.REJECTED, result="bad signature"))
    assert "a further need stops the run" in alert.params["message"]


@pytest.mark.parametrize("status", [AckStatus.REJECTED, AckStatus.FAILED])
def test_lr_changes_the_trainer_refused_are_not_counted_as_applied(status: AckStatus) -> None:
    # Issue 38: a healthy agent whose trainer refused three cuts (its own check found the steps
    # normal) was told "LR restored towards base ... (now 0.64 of base)" at its base LR.
    policy = make()
    for step in (500, 600, 700):
        for action in policy.on_decision(dec(step, T.GRADIENT_EXPLOSION)):
            if action.kind is K.SCALE_LR:
                policy.on_ack(ack(action, status, result="its statistics found the step normal"))
        healthy(policy, step + 1, step + 10)
    assert policy.recovery.lr.current == pytest.approx(1.0)
    assert [a for a in healthy(policy, 710, 1200) if a.kind is K.RESTORE_LR] == []


def test_a_refused_restore_leaves_the_lr_where_the_trainer_has_it() -> None:
    policy = make()
    policy.on_decision(dec(500, T.GRADIENT_EXPLOSION))  # LR x0.4
    (restore,) = [a for a in healthy(policy, 501, 701) if a.kind is K.RESTORE_LR]
    assert policy.recovery.lr.current == pytest.approx(0.5)
    policy.on_ack(ack(restore, AckStatus.REJECTED))
    assert policy.recovery.lr.current == pytest.approx(0.4)
    (again,) = [a for a in healthy(policy, 701, 901) if a.kind is K.RESTORE_LR]
    assert again.params["factor"] == pytest.approx(1.25)
    assert policy.recovery.lr.current == pytest.approx(0.5)
