"""The policy's default answers: one response per cause, proportionate to the evidence.

Decision streams in, actions out, with the default settings (the Guard skips
non-finite updates itself). Each test names the cause and the response.
"""

from __future__ import annotations

import math
import random

import pytest

from spikeguard.actuators import PolicyConfig, RecoveryPolicy
from spikeguard.actuators.responses import Response
from spikeguard.schemas import (
    Ack,
    AckStatus,
    ActionKind,
    AnomalyType as T,
    CheckpointEvent,
    Decision,
    Evidence,
    Urgency,
    decision_id,
    incident_id,
)

R = "run-responses"
K = ActionKind


def dec(
    step: int,
    kind: T | None = None,
    *,
    onset: int | None = None,
    critical: bool | None = None,
    confidence: float = 0.9,
    rules: tuple[str, ...] = (),
    loss: float = 2.0,
    grad: float = 1.0,
    baseline: float = 2.0,
    urgency: Urgency = Urgency.NONE,
) -> Decision:
    """A decision whose evidence has loss and gradient baselines ``baseline`` and 1.0."""
    evidence = Evidence(
        step=step, loss=loss, grad_norm=grad, loss_baseline=baseline, grad_norm_baseline=1.0
    )
    if kind is None:
        return Decision(
            decision_id=decision_id(R, step),
            run_id=R,
            step=step,
            is_anomaly=False,
            evidence=evidence,
        )
    onset = step if onset is None else onset
    return Decision(
        decision_id=decision_id(R, step),
        run_id=R,
        step=step,
        is_anomaly=True,
        type=kind,
        confidence=confidence,
        urgency=urgency,
        rules=list(rules),
        evidence=evidence,
        critical=kind in (T.NON_FINITE, T.EXTREME_LOSS) if critical is None else critical,
        incident_id=incident_id(R, onset),
        incident_onset_step=onset,
    )


def make(ckpts=(100, 200, 300, 400, 500, 600, 700), **config) -> RecoveryPolicy:
    policy = RecoveryPolicy(PolicyConfig(**config), run_id=R)
    for step in ckpts:
        policy.on_checkpoint(
            CheckpointEvent(run_id=R, step=step, checkpoint_id=f"ck-{step}", healthy=True)
        )
    return policy


def feed(policy: RecoveryPolicy, decisions) -> list:
    out = []
    for d in decisions:
        out += policy.on_decision(d)
    return out


def healthy(start: int, end: int) -> list[Decision]:
    return [dec(s) for s in range(start, end)]


def kinds(actions) -> list[ActionKind]:
    return [a.kind for a in actions]


CHANGES = {
    K.ROLLBACK,
    K.SKIP_BATCHES,
    K.SCALE_LR,
    K.SET_LR,
    K.CLIP,
    K.STOP,
    K.SET_EPS,
    K.REDUCE_BATCH_SIZE,
}


def test_a_non_finite_step_the_guard_skipped_gets_an_alert_and_a_recurring_one_a_rollback() -> None:
    policy = make()
    feed(policy, healthy(401, 800))
    once = policy.on_decision(dec(800, T.NON_FINITE))
    assert kinds(once) == [K.ALERT]
    assert once[0].reason.startswith("[non_finite_skipped]") and "skips" in once[0].params.message
    assert not set(kinds(feed(policy, healthy(801, 900)))) & CHANGES
    # Far from the first: again only said. Close after it: the run itself is broken.
    assert kinds(policy.on_decision(dec(900, T.NON_FINITE))) == [K.ALERT]
    again = policy.on_decision(dec(910, T.NON_FINITE))
    assert kinds(again)[:4] == [K.ROLLBACK, K.SKIP_BATCHES, K.SCALE_LR, K.CLIP]
    assert all(a.reason.startswith("[non_finite_recurring]") for a in again)


def test_a_spike_the_run_absorbed_is_not_rolled_back() -> None:
    """A x100 loss for two steps that the run's own clipping made harmless: watched, no rollback."""
    policy = make()
    feed(policy, healthy(401, 800))
    spike = [
        dec(800, T.EXTREME_LOSS, onset=800, loss=200.0, grad=1.0),
        dec(801, T.EXTREME_LOSS, onset=800, loss=150.0, grad=1.0),
    ]  # clipped: the norm stays
    out = feed(policy, spike + healthy(802, 1100))
    assert not set(kinds(out)) & CHANGES, [a.reason for a in out]
    assert any(a.reason.startswith("[absorbed]") for a in out)


def test_an_extreme_loss_whose_update_the_guard_skipped_is_absorbed_whatever_its_gradient() -> None:
    """The Guard skipped the update of the x100 step: the weights never saw its x5000 gradient,
    so a loss back at the baseline a patience later is all there is to know."""
    policy = make()
    feed(policy, healthy(401, 800))
    skipped = dec(800, T.EXTREME_LOSS, onset=800, loss=200.0, grad=5e3).model_copy(
        update={"signals": {"loss_ratio": 100.0, "update_skipped": 1}}
    )
    out = feed(policy, [skipped] + healthy(801, 1100))
    assert not set(kinds(out)) & CHANGES, [a.reason for a in out]
    assert any(a.reason.startswith("[absorbed]") for a in out)
    # skipped, but the loss stayed up: rolled back as before
    policy = make()
    feed(policy, healthy(401, 800))
    held = [
        dec(s, T.EXTREME_LOSS, onset=800, loss=200.0, grad=5e3).model_copy(
            update={"signals": {"loss_ratio": 100.0, "update_skipped": 1}}
        )
        for s in range(800, 804)
    ]
    assert K.ROLLBACK in kinds(feed(policy, held))


def test_a_loss_below_zero_is_back_within_the_margin_of_its_baselines_size() -> None:
    """A Gaussian NLL's baseline is below zero: "back within baseline x 1.1" would ask the loss
    to be 10 % *better* than its baseline before a skipped spike counts as absorbed."""
    policy = make()
    feed(policy, [dec(s, loss=-1.0, baseline=-1.0) for s in range(401, 800)])
    skipped = dec(800, T.EXTREME_LOSS, onset=800, loss=5.0, grad=5e3, baseline=-1.0)
    skipped = skipped.model_copy(update={"signals": {"update_skipped": 1}})
    back = [dec(s, loss=-0.95, baseline=-1.0) for s in range(801, 1100)]
    out = feed(policy, [skipped] + back)
    assert not set(kinds(out)) & CHANGES, [a.reason for a in out]
    assert any(a.reason.startswith("[absorbed]") for a in out)


def test_an_extreme_loss_with_an_unbounded_gradient_is_rolled_back_even_if_the_loss_settles() -> (
    None
):
    """The update of a x1e4 input went through unclipped: the weights moved, the loss looking
    normal a few steps later proves nothing."""
    policy = make()
    feed(policy, healthy(401, 800))
    out = feed(
        policy, [dec(800, T.EXTREME_LOSS, onset=800, loss=200.0, grad=5e3)] + healthy(801, 804)
    )
    assert kinds(out)[:4] == [K.ROLLBACK, K.SKIP_BATCHES, K.SCALE_LR, K.CLIP]
    assert "not absorbed" in out[0].reason
    # Decided on a healthy step, it still names the spike's incident (the Guard records it),
    # and claims the spike's own step with its evidence: the trainer checks that claim against
    # what it saw at that step, and a healthy step's claim would be refused.
    assert {a.incident_id for a in out} == {incident_id(R, 800)}
    changes = [a for a in out if a.kind in CHANGES]
    assert {(a.claim.step, a.claim.type) for a in changes} == {(800, T.EXTREME_LOSS)}
    assert {a.evidence.step for a in changes} == {800}


def test_a_data_spike_is_rolled_back_and_its_window_skipped_with_the_lr_untouched() -> None:
    """Still up a patience later, and an update of it went beyond x10 its baseline gradient:
    the weights moved far on bad data. Rolled back at once, its window skipped."""
    policy = make()
    feed(policy, healthy(401, 800))
    out = feed(policy, [dec(s, T.LOSS_SPIKE, onset=800, grad=20.0) for s in range(800, 804)])
    assert kinds(out) == [K.ROLLBACK, K.SKIP_BATCHES]
    assert (
        out[0].params.target_step == 700 and out[1].params.from_step == 800
    )  # from the onset: 701..799 were fine
    assert all(a.reason.startswith("[data_spike]") for a in out)


def test_an_extreme_loss_whose_updates_all_stayed_bounded_is_the_datas() -> None:
    """Five shuffled-label batches in a CNN (issue 38): the loss x3, the Guard skipped the first
    two updates and the gradients of the rest stayed near their baseline. Still up a patience
    later: rolled back and its window skipped, but the optimizer was never unstable, so the LR
    and the clipping are kept (they cost the CNN half its LR for 700 steps, clipped to the end)."""
    policy = make()
    feed(policy, healthy(401, 800))
    skipped = {"signals": {"loss_ratio": 3.0, "update_skipped": 1}}
    bad = [
        dec(800, T.EXTREME_LOSS, onset=800, loss=6.0, grad=1.5).model_copy(update=skipped),
        dec(801, T.EXTREME_LOSS, onset=800, loss=6.0, grad=1.5).model_copy(update=skipped),
    ] + [dec(s, T.EXTREME_LOSS, onset=800, loss=6.0, grad=1.5) for s in range(802, 804)]
    out = feed(policy, bad)
    assert kinds(out) == [K.ROLLBACK, K.SKIP_BATCHES], [a.reason for a in out]
    assert all(a.reason.startswith("[data_spike]") for a in out)
    assert "bounded" in out[0].reason and policy.recovery.clip.norm is None
    # One unbounded update in it: the optimizer's too (LR cut, clipping), as before.
    policy = make()
    feed(policy, healthy(401, 800))
    bad[2] = dec(802, T.EXTREME_LOSS, onset=800, loss=6.0, grad=50.0)
    assert kinds(feed(policy, bad))[:4] == [K.ROLLBACK, K.SKIP_BATCHES, K.SCALE_LR, K.CLIP]


def extreme_stretch_met_again(policy: RecoveryPolicy, last_bad: int, loss: float = 60.0) -> list:
    """A stretch of extreme batches (the loss x30) longer than the skipped window, every update
    of it bounded (gradients at their baseline): rolled back at its patience with its window
    skipped, and the re-run meets the rest of it on the batches after, up to ``last_bad``. The
    plan of the re-run's rise."""
    feed(policy, healthy(401, 800))
    first = feed(
        policy, [dec(s, T.EXTREME_LOSS, onset=800, loss=loss, grad=1.0) for s in range(800, 804)]
    )
    assert kinds(first) == [K.ROLLBACK, K.SKIP_BATCHES], [a.reason for a in first]
    applied(policy, first[0])
    feed(policy, healthy(701, 800))  # the re-run, up to the batches after the skipped window
    return feed(
        policy,
        [dec(s, T.EXTREME_LOSS, onset=800, loss=loss, grad=1.0) for s in range(800, last_bad + 1)],
    )


def test_an_extreme_stretch_with_bounded_updates_that_comes_back_on_other_data_is_watched() -> None:
    """PaLM's test for a critical rise (issue 36, a signed loss still above zero: a harder
    stretch x30 for 70 steps): its updates all bounded, rolled back once with its window
    skipped, and the re-run meets it again on the batches after. Rolling back again cannot
    help and the optimizer was never unstable: the data's level, watched. It was a second
    recovery of a critical incident, which stopped a healthy run."""
    policy = make()
    again = extreme_stretch_met_again(policy, last_bad=869)
    assert not {K.ROLLBACK, K.SKIP_BATCHES, K.STOP, K.SCALE_LR} & set(kinds(again)), [
        a.reason for a in again
    ]
    assert not policy.stopped
    assert any(a.reason.startswith("[data_level]") for a in again), [a.reason for a in again]
    # It ends at once, the loss back at its level: nothing to undo.
    after = feed(policy, healthy(870, 1000))
    assert not {K.ROLLBACK, K.SKIP_BATCHES, K.STOP} & set(kinds(after)), [a.reason for a in after]


def test_an_extreme_stretch_met_again_that_left_damage_is_rolled_back_at_its_end() -> None:
    """The same stretch, the loss left x1.5 above its level after it: its batches are rolled
    back and skipped at its end, exactly (the watch's end test), and the run goes on."""
    policy = make()
    extreme_stretch_met_again(policy, last_bad=869)
    after = feed(policy, [dec(s, loss=3.0) for s in range(870, 1000)])
    assert kinds(after)[:2] == [K.ROLLBACK, K.SKIP_BATCHES], [a.reason for a in after]
    assert after[0].reason.startswith("[bad_stretch]") and not policy.stopped
    assert after[1].params.to_step == 869


def test_an_extreme_stretch_met_again_with_an_unbounded_update_still_stops_the_run() -> None:
    """One update of the re-run's rise beyond x10 its baseline gradient: the optimizer's too, not
    the data's alone; a critical incident needing a second recovery stops the run, as before."""
    policy = make()
    feed(policy, healthy(401, 800))
    first = feed(
        policy, [dec(s, T.EXTREME_LOSS, onset=800, loss=60.0, grad=1.0) for s in range(800, 804)]
    )
    applied(policy, first[0])
    feed(policy, healthy(701, 800))
    again = feed(
        policy, [dec(s, T.EXTREME_LOSS, onset=800, loss=60.0, grad=50.0) for s in range(800, 812)]
    )
    assert K.STOP in kinds(again) and policy.stopped


def critical_spike() -> list[Decision]:
    """A critical spike at steps 800-803 whose update was not absorbed (loss x6, gradient x50):
    after healthy steps, its plan rolls back, skips the window, halves the LR and clips."""
    return [dec(s, T.EXTREME_LOSS, onset=800, loss=6.0, grad=50.0) for s in range(800, 804)]


def rerun_window_end(plan) -> int:
    """The step at which the re-run has trained past the batches after the plan's skipped window."""
    skip = next(a for a in plan if a.kind is K.SKIP_BATCHES).params
    return skip.from_step + (skip.to_step - skip.from_step + 1) + skip.extra


def applied(policy: RecoveryPolicy, rollback) -> None:
    policy.on_ack(
        Ack(
            run_id=R,
            action_id=rollback.action_id,
            kind=K.ROLLBACK,
            status=AckStatus.APPLIED,
            step=rollback.apply_at_step,
        )
    )


def test_a_rise_that_comes_back_on_other_data_after_the_skip_is_the_datas_level() -> None:
    """PaLM's test: the window that led into the spike was skipped, and the re-run meets the same
    rise on the batches after it. The data's level changed (harder data, not a bad batch): said,
    the LR the rise lowered is given back, and rolling back again could not help."""
    policy = make(skip_extra_batches=40, lr_decrease_factor_spike=0.8, flat_rise_waits=False)
    feed(policy, healthy(401, 800))
    first = feed(policy, [dec(s, T.LOSS_SPIKE, onset=800) for s in range(800, 804)])
    assert kinds(first) == [K.ROLLBACK, K.SKIP_BATCHES, K.SCALE_LR]
    applied(policy, first[0])
    feed(policy, healthy(701, 806))  # the re-run, up to the batches after the skipped window
    again = feed(
        policy,
        [dec(s, T.LOSS_SPIKE, onset=806) for s in range(806, 812)]
        + [dec(s, T.SLOW_RISE, onset=806, confidence=0.7) for s in range(812, 900)],
    )
    assert not {K.ROLLBACK, K.SKIP_BATCHES, K.STOP} & set(kinds(again)), [a.reason for a in again]
    assert [a.params.factor for a in again if a.kind is K.SCALE_LR] == []
    said = [a for a in again if a.reason.startswith("[data_level]")]
    assert said and "other data" in said[0].reason
    assert K.RESTORE_LR in kinds(said) and policy.recovery.lr.current == pytest.approx(1.0)
    # A critical decision is still answered.
    out = feed(
        policy, [dec(900, T.EXTREME_LOSS, onset=900, loss=200.0, grad=5e3)] + healthy(901, 904)
    )
    assert K.ROLLBACK in kinds(out)


def bad_stretch_met_again(policy: RecoveryPolicy, last_bad: int) -> list:
    """A stretch of bad batches longer than the skipped window: a loss spike at 800-803 (x1.5)
    is rolled back with its window skipped, and the re-run meets the rest of the stretch on the
    batches after it, up to step ``last_bad``. The plan of the re-run's rise (said: the data's
    level, by PaLM's test as far as it goes)."""
    feed(policy, healthy(401, 800))
    first = feed(policy, [dec(s, T.LOSS_SPIKE, onset=800, loss=3.0) for s in range(800, 804)])
    assert kinds(first)[:2] == [K.ROLLBACK, K.SKIP_BATCHES]
    applied(policy, first[0])
    feed(policy, healthy(701, 800))  # the re-run, up to the batches after the skipped window
    again = feed(
        policy, [dec(s, T.LOSS_SPIKE, onset=800, loss=3.0) for s in range(800, last_bad + 1)]
    )
    assert any(a.reason.startswith("[data_level]") for a in again), [a.reason for a in again]
    assert not {K.ROLLBACK, K.SKIP_BATCHES} & set(kinds(again))
    return again


def test_a_rise_that_ends_abruptly_after_it_was_called_the_datas_level_was_a_bad_stretch() -> None:
    """The re-run's rise stops as it began: the loss falls most of the way back to the level
    from before it within a step, and stays a little above it (the stretch's updates damaged
    the weights). A harder data level does not end; a stretch of bad batches longer than the
    skipped window does. Its batches are rolled back and skipped, from the rise's onset to its
    last elevated step, nothing more (no margin, no LR cut, no clipping)."""
    policy = make(flat_rise_waits=False)
    bad_stretch_met_again(policy, last_bad=811)
    after = feed(policy, [dec(s, loss=2.4) for s in range(812, 830)])
    assert kinds(after)[:2] == [K.ROLLBACK, K.SKIP_BATCHES], [a.reason for a in after]
    assert all(a.reason.startswith("[bad_stretch]") for a in after[:2])
    skip = after[1].params
    assert (skip.from_step, skip.to_step, skip.extra) == (800, 811, 0)
    assert not {K.SCALE_LR, K.CLIP, K.STOP} & set(kinds(after))
    assert "ended" in after[0].reason
    # Backed by the last elevated step, which the trainer checks against its own numbers (a
    # healthy step's claim would be refused).
    assert {a.claim.step for a in after[:2]} == {811}


def test_a_bad_stretch_that_left_the_loss_at_its_level_is_not_rolled_back() -> None:
    """The same stretch, but the loss back at the level from before it: nothing shows the
    weights were damaged (a harder stretch of data that ended, or bad data the run absorbed),
    so nothing is undone; said once."""
    policy = make(flat_rise_waits=False)
    bad_stretch_met_again(policy, last_bad=811)
    after = feed(policy, healthy(812, 900))
    assert not {K.ROLLBACK, K.SKIP_BATCHES, K.STOP} & set(kinds(after)), [a.reason for a in after]
    said = [a.params.message for a in after if a.kind is K.ALERT]
    assert any("ended" in m and "nothing to undo" in m for m in said), said


def flat_rise(policy: RecoveryPolicy, last: int, loss: float = 3.0) -> list:
    """Healthy to 800, then a loss spike from 800 to ``last`` at ``loss`` (x1.5 its level 2.0)
    with every gradient at its baseline."""
    out = feed(policy, healthy(401, 800))
    return out + feed(
        policy, [dec(s, T.LOSS_SPIKE, onset=800, loss=loss) for s in range(800, last + 1)]
    )


def test_a_flat_rise_with_bounded_updates_is_watched_not_rolled_back() -> None:
    """A step of the data's difficulty (a harder curriculum stage, a new mixture): the loss up
    x1.5 and flat, every gradient at its baseline. Nothing says the weights are damaged, and a
    stretch of bad data would look the same until it ends: one alert, no rollback, no skipped
    batch, no LR cut, while it stays (the watch's 500 steps and after)."""
    policy = make()
    out = flat_rise(policy, last=1400)
    assert not CHANGES & set(kinds(out)), [a.reason for a in out if a.kind in CHANGES]
    said = [a for a in out if a.reason.startswith("[flat_rise]")]
    assert len(said) == 2 and "no rollback" in said[0].params.message  # once per 500-step watch
    assert "bad data" in said[0].params.message


def test_a_spike_judged_by_a_level_shift_within_the_runs_wander_is_watched_not_rolled_back() -> (
    None
):
    """The detector that raised a spike says, at its patience, that the loss's level moved
    within the run's own wander (a LOW `slow_rise`, rule `loss_level_shift`): a flat rise, in
    the detector's own words. It was "still anomalous" and not a spike type, so the spike was
    rolled back and its batches skipped (a healthy signed loss's harder stretch, 21 batches)."""
    policy = make()
    out = feed(policy, healthy(401, 800))
    out += feed(policy, [dec(s, T.LOSS_SPIKE, onset=800, loss=3.0) for s in range(800, 803)])
    shift = dict(onset=800, loss=3.0, urgency=Urgency.LOW, rules=("loss_level_shift",))
    out += feed(policy, [dec(s, T.SLOW_RISE, **shift) for s in range(803, 900)])
    assert not CHANGES & set(kinds(out)), [a.reason for a in out if a.kind in CHANGES]
    assert any(a.reason.startswith("[flat_rise]") for a in out), [a.reason for a in out]


def test_a_flat_rise_that_ends_at_once_leaving_the_loss_up_is_rolled_back_and_skipped_exactly() -> (
    None
):
    """A stretch of 20 bad batches whose updates stayed bounded: watched while it lasts; it ends
    at once, the loss still 20 % above its level (the weights were damaged): rolled back to
    before it and its 20 batches skipped, no more (the bench's bad shard)."""
    policy = make()
    flat_rise(policy, last=819)
    after = feed(policy, [dec(s, loss=2.4) for s in range(820, 850)])
    assert kinds(after)[:2] == [K.ROLLBACK, K.SKIP_BATCHES], [a.reason for a in after]
    assert after[0].params.target_step == 700 and after[0].reason.startswith("[bad_stretch]")
    skip = after[1].params
    assert (skip.from_step, skip.to_step, skip.extra) == (800, 819, 0)
    assert not {K.SCALE_LR, K.CLIP, K.STOP} & set(kinds(after))


def test_a_rise_called_the_datas_level_that_fades_slowly_is_not_rolled_back_again() -> None:
    """A new data level the run learns to fit comes down step by step, not at once: the first
    healthy steps after the rise are still near its level. Nothing more is done; nor when the
    loss stays up with healthy and elevated steps interleaved."""
    policy = make(flat_rise_waits=False)
    bad_stretch_met_again(policy, last_bad=811)
    fading = [dec(s, loss=3.0 - (s - 812) * 0.01) for s in range(812, 912)]
    out = feed(policy, fading + healthy(912, 1000))
    assert not {K.ROLLBACK, K.SKIP_BATCHES, K.STOP} & set(kinds(out)), [a.reason for a in out]

    policy = make(flat_rise_waits=False)
    bad_stretch_met_again(policy, last_bad=811)
    interleaved = [
        dec(s, T.LOSS_SPIKE, onset=800, loss=3.0) if s % 4 == 0 else dec(s, loss=2.9)
        for s in range(812, 1000)
    ]
    out = feed(policy, interleaved)
    assert not {K.ROLLBACK, K.SKIP_BATCHES, K.STOP} & set(kinds(out)), [a.reason for a in out]


def clipped_recovery(policy: RecoveryPolicy) -> int:
    """Healthy to step 800, then :func:`critical_spike`: its plan clips at 1 and its rollback is
    applied. The step at which the re-run is past the batches after the skipped window."""
    feed(policy, healthy(401, 800))
    first = feed(policy, critical_spike())
    assert K.CLIP in kinds(first) and policy.recovery.clip.norm == 1.0
    applied(policy, first[0])
    return rerun_window_end(first)


def test_a_rise_that_is_the_datas_level_gives_back_the_clipping_its_recovery_set() -> None:
    """The recovery of a critical spike clipped; the re-run meets the rise again on the batches
    after the skipped ones: the data's level, not a bad batch. What the recovery set for a bad
    batch is given back, the clipping as the LR (kept, it would bound every later update)."""
    policy = make()
    end = clipped_recovery(policy)
    feed(policy, healthy(701, end - 2))  # the re-run, up to the batches after the skipped window
    again = feed(policy, [dec(s, T.LOSS_SPIKE, onset=end - 2) for s in range(end - 2, end + 4)])
    said = [a for a in again if a.reason.startswith("[data_level]")]
    assert said and "other data" in said[0].reason, [a.reason for a in again]
    lifts = [a for a in said if a.kind is K.CLIP]
    assert len(lifts) == 1 and lifts[0].params.lifts and lifts[0].params.max_norm is None
    assert policy.recovery.clip.norm is None


def test_a_rise_long_after_the_skipped_window_is_a_new_spike() -> None:
    policy = make(skip_extra_batches=40, flat_rise_waits=False)
    feed(policy, healthy(401, 800))
    first = feed(policy, [dec(s, T.LOSS_SPIKE, onset=800) for s in range(800, 804)])
    applied(policy, first[0])
    feed(policy, healthy(701, 950))
    later = feed(policy, [dec(s, T.LOSS_SPIKE, onset=950) for s in range(950, 954)])
    assert kinds(later)[:2] == [K.ROLLBACK, K.SKIP_BATCHES]
    assert later[0].reason.startswith("[data_spike]")


def test_low_confidence_incidents_never_stop_a_run() -> None:
    """A chain of non-critical incidents past every budget: said once each, never a stop."""
    policy = make(
        ckpts=range(100, 5001, 100),
        max_rollbacks_in_window=2,
        rollback_window_steps=10_000,
        rollback_min_steps_before_onset=10,
    )
    out = []
    for onset in range(1000, 5000, 500):
        out += feed(policy, healthy(onset - 40, onset))
        out += feed(
            policy,
            [
                dec(s, T.LOSS_SPIKE, onset=onset, confidence=0.6, grad=20.0)
                for s in range(onset, onset + 4)
            ],
        )
    assert K.STOP not in kinds(out)
    assert not policy.stopped
    assert kinds(out).count(K.ROLLBACK) == 2  # the window's budget, then watched
    assert any(a.reason.startswith("[watch]") and "not critical" in a.reason for a in out)


def test_a_critical_decision_recurring_after_a_recovery_stops_the_run() -> None:
    policy = make()
    feed(policy, healthy(401, 800))
    first = feed(policy, [dec(800, T.NON_FINITE, onset=800), dec(801, T.NON_FINITE, onset=800)])
    applied(policy, next(a for a in first if a.kind is K.ROLLBACK))
    feed(policy, healthy(701, 800))  # the re-run, then the same trouble again
    stop = feed(policy, [dec(s, T.NON_FINITE, onset=800) for s in range(800, 812)])
    assert kinds(stop)[-3:] == [K.CHECKPOINT, K.STOP, K.ALERT] and policy.stopped


def test_no_checkpoint_fallback_only_for_a_confirmed_incident() -> None:
    unconfirmed = make(ckpts=())
    out = feed(
        unconfirmed,
        healthy(1, 50) + [dec(s, T.LOSS_SPIKE, onset=50, grad=20.0) for s in range(50, 54)],
    )
    assert kinds(out) == [K.ALERT] and "no fallback" in out[0].params.message
    assert unconfirmed.recovery.lr.current == 1.0
    confirmed = make(ckpts=())
    out = feed(
        confirmed,
        healthy(1, 50) + [dec(50, T.NON_FINITE, onset=50), dec(51, T.NON_FINITE, onset=50)],
    )
    assert K.SKIP_BATCHES in kinds(out) and K.SCALE_LR in kinds(out)


def test_an_outlier_step_alert_does_not_claim_the_guard_skipped_it() -> None:
    policy = make()
    out = feed(policy, healthy(401, 500) + [dec(500, T.OUTLIER_STEP, critical=False)])
    assert kinds(out) == [K.ALERT]
    assert "skipped by the guard" not in out[0].params.message.lower()
    assert "skip_reason" in out[0].params.message


def test_an_lr_jump_alone_changes_nothing() -> None:
    """A warm restart looks like an LR jump: said, never acted on without a rise after it."""
    policy = make()
    out = feed(
        policy,
        healthy(401, 500)
        + [dec(500, T.LR_OUT_OF_BOUNDS, critical=False, confidence=0.7, rules=("lr_jump",))]
        + healthy(501, 900),
    )
    assert kinds(out) == [K.ALERT] and out[0].reason.startswith("[lr_jump_watched]")


def test_an_lr_induced_rise_holds_the_jump_and_lowers_nothing() -> None:
    """Issue 38 (char_lm, LR x50): a x0.1 factor outlasted the jump (0.244x the schedule at the
    end, +7.3 % final loss). The trainer holds the jump now on and gives the schedule back the
    step it ends: the policy's factor is untouched, nothing is left to restore."""
    policy = make(lr_restore_healthy_steps=10, lr_jump_hold_steps=100)
    feed(policy, healthy(401, 500))
    feed(policy, [dec(500, T.LR_OUT_OF_BOUNDS, critical=False, confidence=0.7, rules=("lr_jump",))])
    out = feed(policy, healthy(501, 505) + [dec(505, T.GRADIENT_EXPLOSION, onset=505)])
    assert kinds(out)[0] is K.HOLD_LR and out[0].reason.startswith("[lr_induced]")
    assert K.SCALE_LR not in kinds(out) and policy.recovery.lr.current == 1.0
    later = feed(policy, healthy(506, 800))
    assert K.RESTORE_LR not in kinds(later) and K.SCALE_LR not in kinds(later)


def test_a_loss_scale_collapse_is_watched_and_nothing_is_changed() -> None:
    policy = make()
    out = feed(
        policy,
        healthy(401, 500)
        + [dec(s, T.LOSS_SCALE_COLLAPSE, critical=False, onset=500) for s in range(500, 530)]
        + healthy(530, 800),
    )
    assert kinds(out) == [K.ALERT] and out[0].reason.startswith("[loss_scale_watched]")
    assert policy.recovery.lr.current == 1.0


def test_recurring_explosions_lower_the_restore_ceiling_each_time() -> None:
    policy = make(
        lr_restore_healthy_steps=10, lr_restore_factor=2.0, lr_ceiling_decrease_factor=0.5
    )
    ceilings = []
    step = 500
    for _ in range(3):
        feed(policy, [dec(step, T.GRADIENT_EXPLOSION, onset=step)] + healthy(step + 1, step + 200))
        ceilings.append(policy.recovery.lr.ceiling)
        step += 200
    assert ceilings == [1.0, 0.5, 0.25]
    assert policy.recovery.lr.current == pytest.approx(
        0.25
    )  # restored up to the ceiling, no further


def test_every_action_names_its_response() -> None:
    policy = make()
    out = feed(
        policy,
        healthy(401, 500)
        + [dec(500, T.GRADIENT_EXPLOSION)]
        + healthy(501, 1000)
        + [dec(s, T.LOSS_SPIKE, onset=1000) for s in range(1000, 1004)],
    )
    names = {r.value for r in Response}
    assert out and all(
        a.reason.startswith("[") and a.reason[1 : a.reason.index("]")] in names for a in out
    )


def test_an_lr_jump_that_needed_a_rollback_is_rolled_back_at_the_old_lr_and_scaled_back_when_it_recurs():
    """The schedule's jump damaged the weights: back to before it without skipping the (good) data,
    at the checkpoint's LR; the jump comes again on the re-run and is scaled back at once."""
    policy = make()
    feed(policy, healthy(401, 750))
    jump = dec(750, T.LR_OUT_OF_BOUNDS, critical=False, confidence=0.7, rules=("lr_jump",))
    out = feed(policy, [jump] + [dec(s, T.LOSS_SPIKE, onset=752) for s in range(752, 756)])
    assert kinds(out) == [K.ALERT, K.HOLD_LR, K.ROLLBACK, K.HOLD_LR], [a.reason for a in out]
    rollback = out[-2]  # ... and the re-run holds the jump at the rate it trained at
    assert rollback.params.target_step == 600 and rollback.reason.startswith("[lr_induced]")
    policy.on_ack(
        Ack(
            run_id=R,
            action_id=rollback.action_id,
            kind=K.ROLLBACK,
            status=AckStatus.APPLIED,
            step=rollback.apply_at_step,
        )
    )
    assert policy.recovery.lr.current == 1.0  # the checkpoint's LR
    feed(policy, healthy(601, 750))
    again = policy.on_decision(jump)
    assert [(a.kind, a.params.factor) for a in again] == [(K.SCALE_LR, pytest.approx(0.1))]


def test_the_new_state_round_trips_through_strict_json_mid_incident() -> None:
    """A pending extreme loss with an infinite gradient, an LR jump armed, explosions counted:
    the snapshot is strict JSON and a policy restored from it answers the same."""
    import json

    policy = make()
    feed(
        policy,
        healthy(401, 700)
        + [dec(700, T.GRADIENT_EXPLOSION, onset=700)]
        + healthy(701, 790)
        + [
            dec(790, T.LR_OUT_OF_BOUNDS, critical=False, rules=("lr_jump",)),
            dec(800, T.EXTREME_LOSS, onset=800, loss=300.0, grad=float("inf")),
        ],
    )
    state = json.loads(json.dumps(policy.state_dict(), allow_nan=False))
    twin = make()
    twin.load_state_dict(state)
    rest = healthy(801, 804)
    assert [(a.kind, a.reason) for a in feed(twin, rest)] == [
        (a.kind, a.reason) for a in feed(policy, rest)
    ]


def _lr_jump_run(jump_to_peak: bool, loss_rise: float, jump: int = 90, steps: int = 160) -> list:
    """A run (seeded) whose LR warms up over 10 steps to 1e-3, decays along a cosine, and jumps at
    ``jump`` for 30 steps: back to the peak (a warm restart) or to x20 the schedule (a mis-set
    schedule, beyond any rate the run trained at); the loss rises by ``loss_rise`` meanwhile."""
    import math
    import random

    from spikeguard.schemas import StepEvent

    rng = random.Random(4)
    events = []
    for step in range(steps):
        lr = 1e-3 * min(1.0, (step + 1) / 10) * (0.55 + 0.45 * math.cos(math.pi * step / steps))
        rise = 1.0
        if jump <= step < jump + 30:
            lr = 1e-3 if jump_to_peak else 20 * lr
            rise = loss_rise if step > jump else 1.0  # the loss follows the step after
        loss = 3.0 * math.exp(-step / 400) * rise * math.exp(0.03 * rng.gauss(0, 1))
        events.append(StepEvent(run_id=R, step=step, time=0.0, loss=loss, grad_norm=1.0, lr=lr))
    return events


@pytest.mark.parametrize(
    "jump_to_peak, loss_rise, scaled_back",
    [
        (False, 1.15, True),  # beyond any rate the run trained at, and the loss rose: the LR did it
        (False, 1.0, False),  # the same jump, the loss within its noise: watched only
        (True, 1.15, False),  # a warm restart back to the peak raises the loss on purpose
        (True, 1.0, False),  # a warm restart the loss does not notice
    ],
)
def test_an_lr_induced_rise_is_answered_with_the_lr_and_a_warm_restart_with_nothing(
    jump_to_peak: bool, loss_rise: float, scaled_back: bool
) -> None:
    """The detectors and fusion on the run's steps, then the policy: a +15 % rise held after an
    LR jump is far inside the young bar of one point (x1.5) and explained by the LR, yet it is
    the LR's doing when the jump went beyond any rate the run had trained at."""
    from spikeguard.lab.backtest import backtest_events

    decisions = backtest_events(_lr_jump_run(jump_to_peak, loss_rise))
    policy = make(ckpts=(20, 40, 60, 80))
    out = feed(policy, decisions)
    changes = [a for a in out if a.kind in CHANGES | {K.HOLD_LR}]
    if scaled_back:
        assert kinds(changes) == [K.HOLD_LR]
        assert changes[0].reason.startswith("[lr_induced]") and 90 <= changes[0].claim.step < 120
        assert changes[0].claim.type is T.LR_INDUCED_RISE
    else:
        assert changes == []


def _lr_blowup(policy: RecoveryPolicy, after: float, steps: int) -> list:
    """An LR jump at 750 and the loss risen after it (level 2.0 before); then ``steps`` healthy
    decisions whose loss sits at ``after``, the detectors having relearned it as the baseline."""
    jump = dec(750, T.LR_OUT_OF_BOUNDS, critical=False, confidence=0.7, rules=("lr_jump",))
    rise = dec(752, T.LR_INDUCED_RISE, critical=False, rules=("lr_induced_rise",), loss=5.0)
    settled = [dec(s, loss=after, baseline=after) for s in range(753, 753 + steps)]
    return feed(policy, healthy(401, 750) + [jump, rise] + settled)


def test_an_lr_blowup_that_damaged_the_model_is_rolled_back_to_before_it() -> None:
    """Issue 38: the digits CNN had collapsed to chance under x50 its LR, and x0.1 alone left it
    there. The loss a window after the scale-back far above its level before: back to before the
    jump at the checkpoint's LR, the (good) data not skipped."""
    out = _lr_blowup(make(), after=4.6, steps=300)
    rollbacks = [a for a in out if a.kind is K.ROLLBACK]
    assert len(rollbacks) == 1 and rollbacks[0].params.target_step == 600, out
    assert rollbacks[0].reason.startswith("[lr_induced]")
    assert rollbacks[0].claim.type is T.LR_INDUCED_RISE  # the claim the trainer backed
    assert K.SKIP_BATCHES not in kinds(out) and K.RESTORE_LR not in kinds(out)
    assert policy_lr_after_ack(rollbacks[0]) == 1.0


def policy_lr_after_ack(rollback) -> float:
    policy = make()
    _lr_blowup(policy, after=4.6, steps=300)
    policy.on_ack(
        Ack(
            run_id=R,
            action_id=rollback.action_id,
            kind=K.ROLLBACK,
            status=AckStatus.APPLIED,
            step=rollback.apply_at_step,
        )
    )
    return policy.recovery.lr.current


def test_an_lr_blowup_the_model_absorbed_is_not_rolled_back() -> None:
    policy = make(lr_restore_healthy_steps=50)
    out = _lr_blowup(policy, after=2.0, steps=300)
    assert K.ROLLBACK not in kinds(out) and K.HOLD_LR in kinds(out)
    assert policy.recovery.lr.current == 1.0  # the jump held, no factor to restore


def test_a_collapsed_model_is_never_called_healthy() -> None:
    """An LR cut (a gradient explosion's x0.4) and then the loss plateaus far above its level
    before the incident, the detectors having relearned it: the LR stays down however many steps
    pass; it is restored once the loss is back. (An LR blow-up's jump is held by the trainer, not
    cut: nothing to restore there, tests above.)"""
    policy = make(ckpts=(), lr_restore_healthy_steps=50)
    explosion = dec(750, T.GRADIENT_EXPLOSION, onset=750)
    settled = [dec(s, loss=4.6, baseline=4.6) for s in range(751, 1751)]
    out = feed(policy, healthy(401, 750) + [explosion] + settled)
    assert K.ROLLBACK not in kinds(out) and K.RESTORE_LR not in kinds(out)
    assert policy.recovery.lr.current == pytest.approx(0.4)
    back = feed(policy, [dec(s) for s in range(1751, 1900)])
    assert K.RESTORE_LR in kinds(back)


def test_a_rise_after_a_recurring_harmful_lr_jump_is_the_lr_s_not_the_data_s() -> None:
    """The re-run meets the schedule's jump again and scales it back at once; if the loss still
    rises, the LR did it again: rolled back without skipping the (good) data (on the GRU seq2seq
    loop the second rollback skipped 10 batches and cut the LR x0.1 more)."""
    policy = make()
    feed(policy, healthy(401, 750))
    jump = dec(750, T.LR_OUT_OF_BOUNDS, critical=False, confidence=0.7, rules=("lr_jump",))
    out = feed(policy, [jump] + [dec(s, T.LOSS_SPIKE, onset=752) for s in range(752, 756)])
    rollback = next(a for a in out if a.kind is K.ROLLBACK)
    policy.on_ack(
        Ack(
            run_id=R,
            action_id=rollback.action_id,
            kind=K.ROLLBACK,
            status=AckStatus.APPLIED,
            step=rollback.apply_at_step,
        )
    )
    feed(policy, healthy(601, 750))
    again = feed(
        policy,
        [
            dec(
                750,
                T.LR_OUT_OF_BOUNDS,
                critical=False,
                confidence=0.7,
                rules=("lr_jump",),
                onset=750,
            )
        ]
        + [dec(s, T.LOSS_SPIKE, onset=750) for s in range(752, 756)],
    )
    assert K.ROLLBACK in kinds(again) and K.SKIP_BATCHES not in kinds(again), kinds(again)


@pytest.mark.parametrize("kind", [T.SLOW_RISE, T.DIVERGENCE, T.OSCILLATION])
def test_a_low_urgency_slow_rise_is_said_once_and_nothing_is_changed(kind: T) -> None:
    """Proportion (issue 36): the detectors give a rise inside the run's own wander at that time
    scale low urgency. One alert per incident at most: no LR cut, no checkpoint, no rollback,
    however long it is said."""
    policy = make()
    feed(policy, healthy(401, 800))
    out = feed(
        policy,
        [dec(s, kind, onset=800, loss=2.1, urgency=Urgency.LOW) for s in range(800, 1000)],
    )
    assert kinds(out) == [K.ALERT], [a.reason for a in out]
    assert out[0].reason.startswith("[slow_watched]")
    assert "low urgency" in out[0].params.message
    assert policy.recovery.lr.current == 1.0


def test_a_rise_outside_the_wander_lowers_the_lr_and_is_rolled_back_only_if_damaged() -> None:
    """Medium urgency (a rise well outside the run's wander): LR steps. After the last one a rise
    still said with the loss near its level is watched, not rolled back: a rollback needs evidence
    that the weights are damaged (the loss far above its level before the rise)."""
    policy = make()
    feed(policy, healthy(401, 800))
    mild = feed(
        policy,
        [dec(s, T.SLOW_RISE, onset=800, loss=2.2, urgency=Urgency.MEDIUM) for s in range(800, 900)],
    )
    assert [a.params.factor for a in mild if a.kind is K.SCALE_LR] == pytest.approx([0.8] * 3)
    assert not {K.ROLLBACK, K.SKIP_BATCHES, K.STOP} & set(kinds(mild)), [a.reason for a in mild]
    watched = [a for a in mild if a.kind is K.ALERT]
    assert len(watched) == 1 and "not damaged" in watched[0].params.message

    policy = make()
    feed(policy, healthy(401, 800))
    damaged = feed(
        policy,
        [dec(s, T.SLOW_RISE, onset=800, loss=4.0, urgency=Urgency.MEDIUM) for s in range(800, 900)],
    )
    assert K.ROLLBACK in kinds(damaged), [a.reason for a in damaged]


def test_an_extreme_loss_after_an_lr_jump_is_rolled_back_with_the_jump_held_and_no_clipping() -> (
    None
):
    """The GRU seq2seq's LR x50 (issue 38): the loss went extreme after the jump. Back to before
    it, the re-run's jump held by the trainer (HOLD_LR); clipping would only stay to the end of
    the run (it did: "Gradients stay clipped at max_norm 1"), the cause being the LR."""
    policy = make()
    feed(policy, healthy(401, 750))
    jump = dec(750, T.LR_OUT_OF_BOUNDS, critical=False, confidence=0.7, rules=("lr_jump",))
    extreme = [dec(s, T.EXTREME_LOSS, onset=752, loss=40.0, grad=50.0) for s in range(752, 756)]
    out = feed(policy, [jump] + extreme)
    rolled = [a for a in out if a.kind is not K.ALERT]
    assert kinds(rolled) == [K.HOLD_LR, K.ROLLBACK, K.HOLD_LR], [a.reason for a in out]
    assert policy.recovery.clip.norm is None


def test_the_lr_a_recovery_cut_is_given_back_once_the_re_run_passed_the_skipped_data() -> None:
    """Issue 38 (digits CNN, seed 2): five shuffled-label batches, one update's gradient past x10:
    rolled back, the window skipped, LR x0.5 and clipping. The re-run trained on the batches
    after the skipped ones without an anomaly: the cause is gone, so the LR comes back at once
    to the checkpoint's (was: x1.25 per 200 healthy steps, 800 steps at a lower LR)."""
    policy = make()
    feed(policy, healthy(401, 800))
    first = feed(policy, critical_spike())
    assert kinds(first)[:4] == [K.ROLLBACK, K.SKIP_BATCHES, K.SCALE_LR, K.CLIP]
    applied(policy, first[0])
    assert policy.recovery.lr.current == pytest.approx(0.5)
    end = rerun_window_end(first)
    before = feed(policy, healthy(701, end - 1))
    assert K.RESTORE_LR not in kinds(before)  # not yet past the batches after the skipped ones
    back = feed(policy, healthy(end - 1, end + 1))
    assert kinds(back) == [K.RESTORE_LR, K.CLIP], [a.reason for a in back]
    assert all(a.reason.startswith("[cause_removed]") for a in back)
    assert back[0].params.factor == pytest.approx(2.0) and policy.recovery.lr.current == 1.0


def test_the_clipping_a_recovery_set_is_lifted_with_the_lr_once_the_re_run_passed_the_data() -> (
    None
):
    """Issue 38: "Gradients stay clipped at max_norm 1 (set by a recovery)" to the run's end. The
    clip comes back as the LR does, at the same decision: lifted to what was in force before."""
    policy = make()
    end = clipped_recovery(policy)
    assert K.CLIP not in kinds(feed(policy, healthy(701, end - 1)))
    back = [a for a in feed(policy, healthy(end - 1, end + 1)) if a.kind is K.CLIP]
    assert len(back) == 1 and back[0].params.lifts and back[0].params.max_norm is None
    assert "lifted: back to no clipping but the trainer's own" in back[0].reason
    assert policy.recovery.clip.norm is None
    assert K.CLIP not in kinds(feed(policy, healthy(end + 1, end + 300)))  # given back once


def test_a_lift_gives_back_the_clipping_that_was_in_force_before_the_recovery() -> None:
    """An explosion had clipped at 1 before the checkpoint the recovery rolled back to, and the
    recovery tightened to 0.5: lifted back to the checkpoint's 1, not off. (Set after that
    checkpoint, the rollback undid it: then lifted to none, as the LR goes to the checkpoint's.)"""
    policy = make()
    feed(policy, healthy(401, 550))
    feed(policy, [dec(550, T.GRADIENT_EXPLOSION, onset=550)] + healthy(551, 800))
    assert policy.recovery.clip.norm == 1.0
    first = feed(policy, critical_spike())
    applied(policy, next(a for a in first if a.kind is K.ROLLBACK))
    assert policy.recovery.clip.norm == 0.5
    back = [a for a in feed(policy, healthy(701, 830)) if a.kind is K.CLIP]
    assert [(a.params.mode, a.params.max_norm) for a in back] == [("lift", 1.0)]
    assert policy.recovery.clip.norm == 1.0


def test_adaptive_clipping_in_force_before_the_recovery_is_not_lifted_to_a_max_norm() -> None:
    """With adaptive clipping the trainer clips at a z, never at the policy's notional norm: the
    checkpoint had that z in force, and the recovery re-sent the same z, so nothing is given back
    (a lift to the notional norm would add a max_norm the trainer never had)."""
    policy = make(clip_mode="adaptive")
    feed(policy, healthy(401, 550))
    feed(policy, [dec(550, T.GRADIENT_EXPLOSION, onset=550)] + healthy(551, 800))
    assert policy.recovery.clip.norm is not None
    first = feed(policy, critical_spike())
    applied(policy, next(a for a in first if a.kind is K.ROLLBACK))
    later = feed(policy, healthy(701, 830))
    assert [a for a in later if a.kind is K.CLIP] == [], [a.reason for a in later]
    assert K.RESTORE_LR in kinds(later)  # the LR still comes back


def test_a_re_run_that_meets_trouble_again_keeps_the_lr_cut() -> None:
    policy = make()
    feed(policy, healthy(401, 800))
    first = feed(policy, critical_spike())
    applied(policy, first[0])
    feed(policy, healthy(701, 780) + [dec(780, T.GRADIENT_EXPLOSION, onset=780)])
    later = feed(policy, healthy(781, 830))
    assert K.RESTORE_LR not in kinds(later) and policy.recovery.lr.current < 0.5
    assert not any(a.kind is K.CLIP and a.params.lifts for a in later)  # the clip is kept too
    assert policy.recovery.clip.norm is not None


def test_a_rollback_that_failed_takes_its_clipping_back_out() -> None:
    """The trainer applies none of a plan whose rollback failed: the policy's clip is not its."""
    policy = make()
    feed(policy, healthy(401, 800))
    first = feed(policy, critical_spike())
    assert policy.recovery.clip.norm == 1.0
    policy.on_ack(
        Ack(
            run_id=R,
            action_id=first[0].action_id,
            kind=K.ROLLBACK,
            status=AckStatus.FAILED,
            step=first[0].apply_at_step,
            result="no checkpoint",
        )
    )
    assert policy.recovery.clip.norm is None


def test_a_rollback_to_a_checkpoint_clipped_before_a_lift_lifts_it_again() -> None:
    """The trainer loads the checkpoint's clipping with its weights; the policy had lifted it
    since, so the plan lifts it again rather than leave a clip nobody set."""
    policy = make()
    feed(policy, healthy(401, 800))
    first = feed(policy, critical_spike())
    applied(policy, first[0])
    assert any(a.kind is K.CLIP and a.params.lifts for a in feed(policy, healthy(701, 820)))
    # a checkpoint of the re-run, taken while the recovery's clip was in force
    policy.on_checkpoint(CheckpointEvent(run_id=R, step=750, checkpoint_id="ck-750", healthy=True))
    feed(policy, healthy(820, 900))
    bounded = [dec(s, T.EXTREME_LOSS, onset=900, loss=6.0, grad=1.0) for s in range(900, 904)]
    second = [a for a in feed(policy, bounded) if a.kind is not K.ALERT]
    assert kinds(second) == [K.ROLLBACK, K.SKIP_BATCHES, K.CLIP], [a.reason for a in second]
    assert second[0].params.target_step == 750 and second[2].params.lifts
    assert policy.recovery.clip.norm is None


def test_a_long_stretch_whose_level_drifted_down_is_still_told_by_its_end() -> None:
    """A long bad stretch the run partly fits: its loss drifts from x1.5 to x1.2 of the level
    before it while it lasts (a 60-batch shard of shuffled targets did so), then falls at once
    to x1.11 when the data is good again: half its remaining height in one step. It ended as bad
    data does, and left the weights damaged: rolled back, its batches skipped to its last
    elevated step above the middle of the fall."""
    policy = make()
    feed(policy, healthy(401, 800))
    drifting = [
        dec(s, T.LOSS_SPIKE, onset=800, loss=3.0 - 0.6 * (s - 800) / 59) for s in range(800, 860)
    ]
    out = feed(policy, drifting)
    assert not CHANGES & set(kinds(out)), [a.reason for a in out]
    after = feed(policy, [dec(s, loss=2.22) for s in range(860, 890)])
    assert kinds(after)[:2] == [K.ROLLBACK, K.SKIP_BATCHES], [a.reason for a in after]
    skip = after[1].params
    assert (skip.from_step, skip.to_step, skip.extra) == (800, 859, 0)


def _signed_stretch_ends(seed: int, offset: float) -> list:
    """A signed loss around -0.05 with step noise 0.02: a harder stretch (+0.3) for 60 steps from
    step 800, then the loss at -0.05 + ``offset``. The actions after the stretch."""
    policy, level = make(), {"baseline": -0.05}
    noise = random.Random(seed)
    feed(policy, [dec(s, loss=-0.05 + 0.02 * noise.gauss(0, 1), **level) for s in range(401, 800)])
    feed(policy, [dec(s, T.LOSS_SPIKE, onset=800, loss=0.25, **level) for s in range(800, 860)])
    return feed(
        policy,
        [dec(s, loss=-0.05 + offset + 0.02 * noise.gauss(0, 1), **level) for s in range(860, 920)],
    )


def test_a_signed_loss_near_zero_back_at_its_level_after_a_stretch_is_rarely_rolled_back() -> None:
    """A signed loss near zero: ten percent of its level is no margin at all (it was 0.005), so
    its noise alone decides whether the loss stayed up; on 40 seeds, back at its level, at most
    2 runs are rolled back (1 of 200 in a wider sweep; judged at the first sign of the fall,
    against fusion's baseline, 12 of these 40 were). What a longer median sees is said: an offset of half its
    step noise that stays (-0.04) is rolled back on 19 of 200 seeds, one of its noise on 99."""
    rolled = [seed for seed in range(40) if CHANGES & set(kinds(_signed_stretch_ends(seed, 0.0)))]
    assert len(rolled) <= 2, rolled
    said = [a.params.message for a in _signed_stretch_ends(0, 0.0) if a.kind is K.ALERT]
    assert any("nothing to undo" in m for m in said), said


def _stretch_ends(seed: int, noise: float, length: int, damage: float, height: float = 2.0) -> list:
    """A positive loss around 0.6 with log-normal step noise ``noise``: a harder stretch (x2, or
    x ``height``) for ``length`` steps from step 800, then the loss at ``1 + damage`` times its
    level before. The actions of the whole run."""
    draw = random.Random(10_000 + seed)
    policy, level = make(), {"baseline": 0.6}

    def loss(at: float) -> float:
        return at * math.exp(noise * draw.gauss(0, 1))

    out = feed(policy, [dec(s, loss=loss(0.6), **level) for s in range(401, 800)])
    end = 800 + length
    out += feed(
        policy,
        [
            dec(s, T.LOSS_SPIKE, onset=800, loss=loss(0.6 * height), **level)
            for s in range(800, end)
        ],
    )
    return out + feed(
        policy, [dec(s, loss=loss(0.6 * (1 + damage)), **level) for s in range(end, end + 100)]
    )


@pytest.mark.heavy
def test_a_noisy_losss_harder_stretch_that_ends_at_its_level_is_rarely_rolled_back() -> None:
    """A stretch that ended with the loss back at its level is healthy, whatever its noise. The
    damage test compares medians of the 10, 20 and 40 losses after the stretch's last elevated
    step with medians of as many healthy losses before its onset, at four standard errors of
    such a median (0.2 % one-sided per look for a Gaussian): at most 5 of these 240 healthy runs
    (log noise 0.05-0.15, stretches of 5 and 60 steps, 40 seeds each) are rolled back (4, two
    seeds at noise 0.1 and 0.15; 8 of 1,600 in a wider sweep). It
    compared the median of the ten losses at the first sign of the fall, some of them still the
    stretch's (the largest of the losses after it), with fusion's lagging baseline: 49 of 240
    were rolled back and their good batches skipped."""
    rolled = [
        (noise, length, seed)
        for noise in (0.05, 0.1, 0.15)
        for length in (5, 60)
        for seed in range(40)
        if CHANGES & set(kinds(_stretch_ends(seed, noise, length, damage=0.0)))
    ]
    assert len(rolled) <= 5, rolled


@pytest.mark.parametrize(("noise", "least"), [(0.1, 36), (0.15, 27)])
@pytest.mark.parametrize("length", [5, 60])
def test_a_stretch_that_left_a_noisy_loss_up_by_more_than_its_noise_is_rolled_back(
    length: int, noise: float, least: int
) -> None:
    """The same stretch leaving the loss up by 15 % at log noise 0.1 or 0.15 (1.4 and 1 of its
    noise; a look at ten losses does not tell it from noise, one at forty does) damaged the
    weights: rolled back and its batches skipped on most seeds. A positive loss is looked at on
    the mean of its logs: 40 and 39 of 40 at 0.1, 30 and 33 at 0.15; medians of its losses found
    35 and 34, 21 and 24 (the biased median of the ten at the fall's first sign 72 of 80 at 0.1,
    at 49 false rollbacks of 240)."""
    rolled = [
        seed
        for seed in range(40)
        if {K.ROLLBACK, K.SKIP_BATCHES} <= set(kinds(_stretch_ends(seed, noise, length, 0.15)))
    ]
    assert len(rolled) >= least, rolled


@pytest.mark.heavy
@pytest.mark.parametrize("noise", [0.5, 0.8])
def test_a_very_noisy_stretch_that_seems_to_end_and_goes_on_is_not_rolled_back(noise) -> None:
    """A healthy x2 stretch of 60 steps at log noise 0.5-0.8: the median of its last ten dips half
    way to the level by chance, and the end was declared there; the stretch's own losses after
    that point were then taken for the losses after it, and called damage: 12 and 14 of 40
    healthy runs rolled back, their good batches skipped. Losses after an end back above the
    middle of its fall mean it had not ended: watched on (1 and 0 of 40)."""
    rolled = [
        seed
        for seed in range(40)
        if {K.ROLLBACK, K.SKIP_BATCHES} <= set(kinds(_stretch_ends(seed, noise, 60, 0.0)))
    ]
    assert len(rolled) <= 2, rolled


@pytest.mark.heavy
def test_a_cnns_data_fault_that_left_its_noisy_loss_up_x1_8_is_found_in_the_mean_of_its_logs() -> (
    None
):
    """A loss as noisy as the user loops' CNN's (log noise 0.5), five bad batches x50, the loss
    left x1.8 afterwards: rolled back on most seeds (35 of 40). This guards the power, it is no
    fix: on such log-normal noise medians found 36. On the real CNN they did not
    (benchmarks/bench_user_loops.py seeds 30-39: 5 of 10 data faults rolled back on medians, 9
    of 10 on the mean of its logs; `tests/benchmarks/test_bench_user_loops.py` holds one)."""
    rolled = [
        seed
        for seed in range(40)
        if {K.ROLLBACK, K.SKIP_BATCHES} <= set(kinds(_stretch_ends(seed, 0.5, 5, 0.8, height=50.0)))
    ]
    assert len(rolled) >= 25, rolled


def _other_stretch(seed: int) -> list:
    """A second generator of healthy harder stretches, not the one the damage test was chosen on:
    Student-t(3) step noise in log space on AR(phi) wander, a level of 0.3, 1 or 3 that falls or
    stays, noise 1-10 %, a stretch x1.3-x3 for 8-200 steps from step 800, then back on its trend.
    The actions of the whole run."""
    draw = random.Random(77_000 + seed)
    start = draw.choice([0.3, 1.0, 3.0])
    spread, phi = draw.choice([0.01, 0.03, 0.06, 0.1]), draw.choice([0.0, 0.3, 0.8])
    height, length = draw.choice([1.3, 2.0, 3.0]), draw.choice([8, 30, 200])
    decay = draw.choice([0.0, 0.0003])
    wander = 0.0

    def trend(step: int) -> float:
        return start * math.exp(-decay * (step - 400))

    def loss(step: int, times: float = 1.0) -> float:
        nonlocal wander
        t3 = draw.gauss(0, 1) / math.sqrt(sum(draw.gauss(0, 1) ** 2 for _ in range(3)) / 3)
        wander = phi * wander + math.sqrt(1 - phi * phi) * t3
        return trend(step) * times * math.exp(spread * wander / math.sqrt(3))

    policy, end = make(), 800 + length
    out = feed(policy, [dec(s, loss=loss(s), baseline=trend(s)) for s in range(401, 800)])
    out += feed(
        policy,
        [
            dec(s, T.LOSS_SPIKE, onset=800, loss=loss(s, height), baseline=trend(799))
            for s in range(800, end)
        ],
    )
    return out + feed(
        policy, [dec(s, loss=loss(s), baseline=trend(s)) for s in range(end, end + 100)]
    )


@pytest.mark.heavy
def test_another_generators_healthy_stretches_that_end_are_rarely_rolled_back() -> None:
    """The damage test checked on runs it was not chosen on (:func:`_other_stretch`, 200 seeds):
    at most 4 acted on (3; 6 of 400 in a wider sweep, all at noise 6-10 %). Judged at the first
    sign of the fall against fusion's baseline, 39 of 400 were."""
    acted = [seed for seed in range(200) if CHANGES & set(kinds(_other_stretch(seed)))]
    assert len(acted) <= 4, acted
