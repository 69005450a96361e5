"""What a user sees and controls: every action said out loud, the run's summary, the modes,
the recovery budget, following a rollback, resume, and clipping the Guard measures first."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from producers_helpers import Tiny, acks, action, make_guard, send, train

from spikeguard.errors import ConfigError
from spikeguard.producers import Guard, GuardConfig
from spikeguard.schemas import AckStatus, ActionKind, StepEvent, decode

K = ActionKind
GUARD_LOG = "spikeguard.producers.guard"


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == GUARD_LOG
    ]


def action_with(kind, at, incident_id=None, reason="", **params):
    """An action as the actuator sends it: with the incident it answers and its reason."""
    return action(kind, at, **params).model_copy(
        update={"incident_id": incident_id, "reason": reason}
    )


def _plan(at: int = 30) -> list:
    """One incident's plan: roll back, skip the data that led into it, halve the LR."""
    why = dict(decision_id="d1", incident_id="inc-7", reason="loss spike at step 28")
    return [
        action_with(K.ROLLBACK, at, target_step=20, **why),
        action_with(K.SKIP_BATCHES, at, from_step=21, to_step=28, extra=4, **why),
        action_with(K.SCALE_LR, at, factor=0.5, **why),
    ]


def test_each_action_is_one_warning_line_with_what_why_cost_and_incident(bus, tmp_path, caplog):
    caplog.set_level(logging.WARNING)  # the default level: nothing configured
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    send(bus, *_plan(), guard=guard)
    train(guard, tiny, 50)
    summary = guard.close()
    lines = [
        m
        for m in _warnings(caplog)
        if m.startswith("spikeguard: rollback")
        or m.startswith("spikeguard: skip_batches")
        or m.startswith("spikeguard: scale_lr")
    ]
    assert len(lines) == 3, lines
    rollback, skip, lr = lines
    assert "at step 30" in rollback and "rolled back to step 20" in rollback
    assert "why: loss spike at step 28" in rollback and "10 steps to re-run" in rollback
    assert "(incident inc-7)" in rollback
    assert "12 batches skipped (12 steps' data)" in skip
    # Issue 38: the rollback said "LR now 0.01" before the cut that follows it in the same
    # recovery. The LR is said by the action that sets it; the others did not move it.
    assert "LR" not in rollback.split("; cost: ")[1] and "LR" not in skip.split("; cost: ")[1]
    assert "LR now 0.005" in lr
    # close() logs the one-paragraph summary and returns it; summary() gives the same any time
    assert str(summary) in _warnings(caplog)
    assert summary == guard.summary()
    assert summary.steps_kept == 50 and summary.steps_rerun == 10 and summary.steps_run == 60
    assert summary.batches_skipped == 12 and summary.incidents == 1
    assert summary.actions == {"rollback": 1, "skip_batches": 1, "scale_lr": 1}
    assert "50 steps kept of 60 run; 10 re-run after rollbacks, 12 batches" in str(summary)


def test_a_rollback_that_moves_the_lr_says_the_checkpoint_s_and_the_cut_after_it_the_new(
    bus, tmp_path, caplog
):
    """Each line's cost is true when it is said: an LR cut after the checkpoint is undone by the
    rollback (its line says so), and the plan's own cut, applied next, says the LR it leaves."""
    caplog.set_level(logging.WARNING)
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    send(
        bus, action_with(K.SCALE_LR, 25, factor=0.1, reason="an earlier cut"), *_plan(), guard=guard
    )
    train(guard, tiny, 50)
    guard.close()
    lines = [m for m in _warnings(caplog) if "; why: " in m]  # the actions' lines
    costs = [m.split(" at step ")[0] + ": " + m.split("; cost: ")[1] for m in lines]
    assert costs == [
        "spikeguard: scale_lr: LR now 0.001",  # the earlier cut, at step 25
        "spikeguard: rollback: 10 steps to re-run, LR back to the checkpoint's 0.01 (incident inc-7)",
        "spikeguard: skip_batches: 12 batches skipped (12 steps' data) (incident inc-7)",
        "spikeguard: scale_lr: LR now 0.005 (incident inc-7)",
    ], lines


def test_a_local_skip_is_said_at_warning(bus, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)

    def poison(g, data, batch):
        if g.step_count == 5:
            batch[0].mul_(float("nan"))

    train(guard, tiny, 8, on_step=poison)
    guard.close()
    assert any("skipped the update of step 5: non-finite" in m for m in _warnings(caplog))


def test_an_outlier_skip_says_how_far_over_its_threshold_not_a_sigma_count(bus, tmp_path, caplog):
    """The skip rule's measure is the residual over its threshold (1.0 at the threshold), not a
    z-score: a line saying "z=1.0" reads as one sigma, an ordinary step skipped for nothing."""
    caplog.set_level(logging.WARNING)
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)

    def spike(g, data, batch):
        if g.step_count == 35:
            batch[1].add_(1e3)

    train(guard, tiny, 40, on_step=spike)
    guard.close()
    line = next(m for m in _warnings(caplog) if "skipped the update of step 35" in m)
    assert "z=" not in line
    assert re.search(r"loss at [0-9.]+x its outlier threshold", line), line
    assert guard.summary().updates_skipped == 1


def _run(tmp_path, bus, plan: bool, spike_at: int, **config):
    """40 steps of the tiny problem with one outlier step; ``plan``: the pipeline sends _plan()."""
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, **config)
    if plan:
        send(bus, *_plan(), guard=guard)

    def spike(g, data, batch):
        if g.step_count == spike_at:
            batch[1].add_(1e3)  # a loss spike

    train(guard, tiny, 40, on_step=spike)
    guard.close()
    return tiny.params(), guard


def test_observe_mode_applies_nothing_and_says_what_it_would_do(tmp_path, caplog):
    from spikeguard.bus import EmbeddedBus

    caplog.set_level(logging.WARNING)
    with EmbeddedBus() as bus_a, EmbeddedBus() as bus_b:
        # the reference: the same run with no action and no local skip
        plain, _ = _run(tmp_path / "a", bus_a, plan=False, spike_at=35, skip_outliers=False)
        observed, guard = _run(tmp_path / "b", bus_b, plan=True, spike_at=35, mode="observe")
        statuses = [a.status for a in acks(bus_b) if a.kind is not K.CHECKPOINT]
    assert all(torch.equal(a, b) for a, b in zip(plain, observed))
    assert guard.counters["rollbacks"] == 0 and guard.counters["skipped_updates"] == 0
    assert statuses == [AckStatus.REJECTED] * 3  # the pipeline hears it was not applied
    said = _warnings(caplog)
    assert any(
        m.startswith("spikeguard: would rollback at step 30")
        and "observe mode" in m
        and "(incident inc-7)" in m
        for m in said
    )
    assert any(m.startswith("spikeguard: would skip the update of step 35") for m in said)
    summary = guard.summary()
    assert summary.mode == "observe" and summary.actions == {}
    assert summary.withheld == {"rollback": 1, "skip_batches": 1, "scale_lr": 1, "skip_update": 1}


def test_skip_only_mode_takes_the_local_skip_and_withholds_the_pipeline_actions(bus, tmp_path):
    _, guard = _run(tmp_path, bus, plan=True, spike_at=35, mode="skip-only")
    assert guard.counters["rollbacks"] == 0 and guard.lr.scale == 1.0
    assert guard.counters["skipped_updates"] == 1  # the outlier step's update was skipped
    assert guard.summary().withheld == {"rollback": 1, "skip_batches": 1, "scale_lr": 1}


def test_mode_is_checked_and_named_in_the_error(bus, tmp_path):
    with pytest.raises(ValueError, match="mode"):
        make_guard(Tiny(), bus, tmp_path, mode="watch")


def test_a_recovery_past_the_budget_is_refused_whole_and_said(bus, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    tiny = Tiny()
    # 100 planned steps, 5 % = 5 steps of data, floor 0: the 12-step skip window is over it
    guard = make_guard(tiny, bus, tmp_path, max_skip_share=0.05, recovery_min_steps=0)
    guard.data(tiny.loader, max_steps=100)
    # the rollback alone (10 steps of 100) is within budget; its skip window is not: the
    # rollback must not go ahead without it (the same bad data would be read again)
    send(bus, *[a.model_copy(update={"incident_id": "inc-9"}) for a in _plan()], guard=guard)
    train(guard, tiny, 100)
    guard.close()
    assert guard.counters["rollbacks"] == 0 and guard.counters["skipped_batches"] == 0
    assert guard.lr.scale == 1.0  # the plan, whole
    refused = [a for a in acks(bus) if a.kind in (K.ROLLBACK, K.SKIP_BATCHES, K.SCALE_LR)]
    assert [a.status for a in refused] == [AckStatus.REJECTED] * 3
    assert "over the recovery budget" in refused[0].result
    assert any(
        m.startswith("spikeguard: would rollback")
        and "over the recovery budget" in m
        and "skip the data of 12 steps" in m
        for m in _warnings(caplog)
    )
    assert guard.step_count == 100


def test_the_loop_follows_a_rollback(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    heard, evals = [], {}  # an eval every 10 steps, keyed by step

    def follow(from_step, to_step):
        heard.append((from_step, to_step))
        for step in [s for s in evals if s >= to_step]:  # those steps' results are undone
            del evals[step]

    guard.on_rollback(follow)
    guard.on_rollback(lambda *_: 1 / 0)  # a listener that raises is logged, never fatal
    send(bus, action(K.ROLLBACK, 25, target_step=20), guard=guard)
    runs = []
    for batch in guard.data(tiny.loader, max_steps=40):
        if guard.step_count % 10 == 0:  # the Guard's counter: goes back with the rollback
            with torch.no_grad():
                evals[guard.step_count] = float(
                    torch.nn.functional.mse_loss(tiny.model(batch[0]), batch[1])
                )
            runs.append(guard.step_count)
        guard.step(tiny.loss(batch))
    guard.close()
    assert heard == [(25, 20)]
    assert runs == [0, 10, 20, 20, 30] and sorted(evals) == [0, 10, 20, 30]


def test_max_steps_is_reached_though_a_skip_window_eats_the_finite_loader(bus, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    tiny = Tiny()  # 64 batches: one pass is 64 steps
    guard = make_guard(tiny, bus, tmp_path)
    send(bus, action(K.SKIP_BATCHES, 10, from_step=5, to_step=9, extra=30), guard=guard)
    data = guard.data(tiny.loader, max_steps=64)
    for batch in data:
        guard.step(tiny.loss(batch))
    guard.close()
    assert guard.step_count == 64  # the loader was read again from its start, not cut short
    assert any("re-reading the data from its start" in m for m in _warnings(caplog))


def test_a_skip_window_past_the_end_of_the_data_is_said(bus, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    send(bus, action(K.SKIP_BATCHES, 50, from_step=45, to_step=49, extra=40), guard=guard)
    for batch in guard.data(tiny.loader):  # one pass, no max_steps
        guard.step(tiny.loss(batch))
    guard.close()
    assert guard.step_count < 64
    assert any("reaches past the end of the data" in m for m in _warnings(caplog))


def test_resume_never_must_auto(bus, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    tiny = Tiny()
    first = make_guard(tiny, bus, tmp_path, run_id="same", resume="never")
    train(first, tiny, 20)
    first.close(finished=False)  # interrupted
    again = make_guard(Tiny(), bus, tmp_path, run_id="same", resume="auto")
    assert again.step_count == 20
    again.close(finished=False)
    fresh = make_guard(Tiny(), bus, tmp_path, run_id="same", resume="never")
    assert fresh.step_count == 0
    assert any("resume='never'" in m and "starts from step 0" in m for m in _warnings(caplog))
    fresh.close(finished=False)
    with pytest.raises(ConfigError, match="resume='must'"):
        make_guard(Tiny(), bus, tmp_path, run_id="same", resume="must")
    assert (
        GuardConfig(resume=True).resume.value == "auto"
        and GuardConfig(resume=False).resume.value == "never"
    )
    assert GuardConfig().resume.value == "auto"


def test_the_guard_clips_after_measuring_the_true_norm(bus, tmp_path, topics):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, max_grad_norm=0.01)
    norms = []
    tiny.optimizer.register_step_pre_hook(
        lambda opt, *a: norms.append(
            float(torch.nn.utils.get_total_norm([p.grad for p in tiny.model.parameters()]))
        )
    )
    train(guard, tiny, 5)
    guard.close()
    published = [decode(r.value, StepEvent).grad_norm for r in bus.read_all(topics.steps)]
    assert published[0] > 0.02  # the detectors see the norm before clipping
    assert max(norms) <= 0.0101  # the update uses the clipped gradient


def test_guard_keyword_arguments_win_over_the_config(bus, tmp_path):
    tiny = Tiny()
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        run_id="kw",
        bus=bus,
        mode="observe",
        resume="never",
        config=GuardConfig(checkpoint_dir=str(tmp_path / "c"), checkpoint_every=7),
    )
    assert guard.mode.value == "observe" and guard.config.checkpoint_every == 7
    guard.close()


def test_a_skip_for_a_non_finite_gradient_does_not_call_a_finite_loss_non_finite(
    bus, tmp_path, caplog
):
    # Issue 38: "non-finite loss or gradient (loss 1.427e+28)" read as a finite loss called
    # non-finite; the line says which of the two was not finite.
    caplog.set_level(logging.WARNING)
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    data = guard.data(tiny.loader, max_steps=8)
    weight = next(tiny.model.parameters())
    for batch in data:
        if guard.step_count != 5:
            guard.step(tiny.loss(batch))
            continue
        # A finite loss whose gradient overflowed (Tiny.loss runs the backward).
        hook = weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        loss = tiny.loss(batch)
        hook.remove()
        guard.step(loss.detach() * 0 + 1.427e28)
    guard.close()
    line = next(m for m in _warnings(caplog) if "skipped the update of step 5" in m)
    assert "non-finite gradient" in line and "non-finite loss" not in line, line
    assert "1.427e+28" in line, line


def test_the_summary_says_a_recovery_s_clipping_is_still_in_force(bus, tmp_path):
    # Issue 38: "clip 1.0 applied during a recovery stays for the rest of the run, never said".
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    send(bus, action_with(K.CLIP, 5, max_norm=1.0, reason="loss spike at step 3"), guard=guard)
    train(guard, tiny, 12)
    summary = str(guard.close())
    assert "Gradients stay clipped at max_norm 1 (set by a recovery)" in summary, summary


def test_a_lift_gives_back_the_user_s_own_clipping_and_the_summary_says_so(bus, tmp_path):
    # Issue 38: a recovery's clip is given back once its cause is gone (CLIP, mode lift); the
    # user's own max_grad_norm is never loosened.
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, max_grad_norm=2.0)
    set_, lift = (
        action_with(K.CLIP, 5, max_norm=1.0, reason="loss spike at step 3"),
        action_with(K.CLIP, 9, mode="lift", reason="[cause_removed] the data is gone"),
    )
    send(bus, set_, lift, guard=guard)
    train(guard, tiny, 12)
    summary = guard.close()
    assert (guard.clipper.max_norm, guard.clipper.z) == (2.0, None)
    assert summary.actions == {"clip": 1, "lift_clip": 1}
    assert "stay clipped" not in str(summary), summary
    assert (
        "The clipping a recovery set was lifted at step 9 (clipped at your own max_norm 2 now)"
        in str(summary)
    )
    assert {a["kind"]: a["status"] for a in guard.acks.applied if a["step"] == 9} == {
        "clip": "applied"
    }


def test_the_summary_does_not_call_the_user_s_own_clipping_a_recovery_s(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, max_grad_norm=1.0)
    train(guard, tiny, 12)
    assert "clipped" not in str(guard.close())


def test_a_signal_below_its_level_is_said_so_not_as_a_negative_multiple() -> None:
    # Seen by a new user: "grad norm at -0.03x" beside a loss outlier whose gradient was low.
    from spikeguard.producers.step_halves import _over

    assert (_over(1.06), _over(-0.03), _over(None)) == ("1.06x", "below its level", "n/a")
