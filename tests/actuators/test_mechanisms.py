"""Attention-logit growth through the policy: a QK-clip under the bar, an LR cut by the evidence."""

from __future__ import annotations

from spikeguard.actuators import PolicyConfig, RecoveryPolicy
from spikeguard.schemas import ActionKind as K, AnomalyType as T, Decision, decision_id, incident_id

R = "run-1"


def growth(step: int, value: float, bar: float = 90.0) -> Decision:
    return Decision(
        decision_id=decision_id(R, step),
        run_id=R,
        step=step,
        is_anomaly=True,
        type=T.ATTENTION_LOGIT_GROWTH,
        confidence=0.9,
        incident_id=incident_id(R, 13),
        incident_onset_step=13,
        rules=["attention_logit_growth"],
        signals={"attention_logit_growth": value, "attention_logit_growth_bar": bar, "by": "rules"},
    )


def healthy(step: int) -> Decision:
    return Decision(decision_id=decision_id(R, step), run_id=R, step=step, is_anomaly=False)


def test_growth_gets_a_qk_clip_under_the_bar_and_an_lr_cut_scaled_to_the_evidence():
    policy = RecoveryPolicy(PolicyConfig(), run_id=R)
    actions = policy.on_decision(growth(13, 360.0))
    assert [a.kind for a in actions] == [K.QK_CLIP, K.SCALE_LR]
    clip, cut = actions
    assert clip.params.threshold == 30.0  # 1/3 of the bar 90: the run's level (its floor)
    assert cut.params.factor == 0.25  # bar/value: 90/360
    assert clip.reason.startswith("[mechanism] attention logit 360 at step 13")
    assert clip.claim is not None and clip.claim.type is T.ATTENTION_LOGIT_GROWTH
    assert clip.apply_at_step == 14


def test_a_cut_is_at_least_the_setting_and_never_repeated_for_the_same_evidence():
    policy = RecoveryPolicy(PolicyConfig(), run_id=R)
    first = policy.on_decision(growth(13, 100.0))  # just over the bar: still halved
    assert [a.params.factor for a in first if a.kind is K.SCALE_LR] == [0.5]
    again = policy.on_decision(growth(14, 120.0))  # 90/120 > 0.5: the LR is already lower
    assert [a.kind for a in again] == [K.QK_CLIP]
    deeper = policy.on_decision(growth(15, 900.0))  # 0.1 of base asked: x0.2 from 0.5
    assert [round(a.params.factor, 6) for a in deeper if a.kind is K.SCALE_LR] == [0.2]


def test_the_cut_is_restored_once_the_signals_have_calmed():
    config = PolicyConfig(lr_restore_healthy_steps=5, lr_restore_factor=2.0)
    policy = RecoveryPolicy(config, run_id=R)
    policy.on_decision(growth(13, 180.0))
    kinds = [[a.kind for a in policy.on_decision(healthy(s))] for s in range(14, 24)]
    assert kinds[:4] == [[]] * 4 and kinds[4] == [K.RESTORE_LR]  # after 5 healthy decisions
    assert [K.RESTORE_LR] not in kinds[5:]  # back at the base LR: nothing more to restore
