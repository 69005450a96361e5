"""The run families: seeded, split by seed into halves that never meet, faults where labelled."""

from __future__ import annotations

import math
from argparse import Namespace

import numpy as np
import pytest

from spikeguard.cli import evaluate as evaluate_cli
from spikeguard.cli import main
from spikeguard.lab import families
from spikeguard.lab.families import (
    BATCHES,
    DEVELOPMENT,
    FAULTS,
    KINDS,
    NOISES,
    SCHEDULES,
    TEST,
    WANDERS,
    Case,
    Family,
    case_of,
    development_cases,
    generate,
    half_of,
    seeds_of,
)


def losses(run) -> list[str]:
    return [repr(e.loss) for e in run.events]  # repr: NaN compares equal to itself


def test_the_same_seed_gives_the_same_run_and_another_seed_another():
    first, again = generate(case_of(7, 800)), generate(case_of(7, 800))
    assert first.case == again.case and losses(first) == losses(again)
    assert first.labels == again.labels
    assert [e.grad_norm for e in first.events] == [e.grad_norm for e in again.events]
    assert losses(generate(case_of(9, 800))) != losses(first)


def test_even_seeds_develop_odd_seeds_test_and_the_halves_never_meet():
    development, test = seeds_of(DEVELOPMENT, 100), seeds_of(TEST, 100)
    assert all(s % 2 == 0 for s in development) and all(s % 2 == 1 for s in test)
    assert not set(development) & set(test)
    assert {half_of(s) for s in development} == {DEVELOPMENT}
    assert {c.half for c in development_cases(100, 600)} == {DEVELOPMENT}
    assert seeds_of(TEST, 3, first=10) == [11, 13, 15]
    with pytest.raises(ValueError, match="half must be"):
        seeds_of("train", 3)


def test_no_development_function_draws_a_test_seed(monkeypatch):
    """The development entry points (the lab's and the CLI's) only ever ask for even seeds."""
    asked: list[int] = []
    real = families.case_of

    def spy(seed, *args, **kwargs):
        asked.append(seed)
        return real(seed, *args, **kwargs)

    monkeypatch.setattr(families, "case_of", spy)
    monkeypatch.setattr(evaluate_cli, "case_of", spy)
    families.development_cases(30, 600)
    args = Namespace(families=DEVELOPMENT, runs=6, steps=500)
    assert len(list(evaluate_cli._family_runs(args))) == 6
    assert asked and all(half_of(seed) == DEVELOPMENT for seed in asked)


@pytest.mark.parametrize("half", [DEVELOPMENT, TEST])
def test_each_half_draws_from_every_family_and_fault(half):
    cases = [case_of(seed) for seed in seeds_of(half, 400)]
    for axis, values in zip(Family._fields, (NOISES, WANDERS, SCHEDULES, BATCHES, KINDS)):
        assert {getattr(c.family, axis) for c in cases} == set(values), axis
    assert {c.fault for c in cases} == set(FAULTS)


def forced(fault: str, seed: int, family: Family | None = None, steps: int = 1500):
    case = case_of(seed, steps, fault)
    return generate(case._replace(family=family) if family else case)


GAUSSIAN = Family("gaussian", "ar1", "constant", 64, "positive")


def test_a_healthy_run_has_no_label_and_no_non_finite_loss():
    for seed in seeds_of(DEVELOPMENT, 12):
        run = forced("none", seed, steps=800)
        assert not any(label.label for label in run.labels)
        assert all(math.isfinite(e.loss) and e.grad_norm > 0 for e in run.events)


def test_spikes_are_single_points_of_at_least_1_3x_after_the_earlier_ones_healed():
    run = forced("spikes", 4, GAUSSIAN, steps=4000)
    at = [i for i, label in enumerate(run.labels) if label.label]
    assert at and all(label.kind == "spikes" for label in run.labels if label.label)
    assert all(b - a >= 300 for a, b in zip(at, at[1:]))  # each after the last one healed
    loss = np.array([e.loss for e in run.events])
    for i in at:
        assert loss[i] >= 1.3 * np.median(loss[i - 20 : i]) * 0.9  # 1.3x, less the step noise


def test_nan_and_lr_blowup_faults_are_labelled_where_they_are():
    run = forced("nan", 6, GAUSSIAN)
    nan = [i for i, e in enumerate(run.events) if not math.isfinite(e.loss)]
    assert nan and [i for i, lab in enumerate(run.labels) if lab.label] == nan
    assert {run.labels[i].kind for i in nan} == {"non_finite"}
    run = forced("lr_blowup", 8, GAUSSIAN)
    first = next(i for i, lab in enumerate(run.labels) if lab.label)
    assert all(lab.label for lab in run.labels[first:])  # it never comes back
    assert run.events[-1].loss > 4 * run.events[first - 1].loss
    assert run.events[-1].lr > 9 * run.events[first - 60].lr
    # labelled from the step the LR is multiplied: the fault is there before the loss shows it
    assert run.events[first].lr > 9 * run.events[first - 1].lr


def test_a_signed_loss_crosses_zero_and_a_noise_hiding_any_spike_gets_a_nan_instead():
    run = forced("none", 10, Family("gaussian", "none", "constant", 64, "signed"))
    values = [e.loss for e in run.events]
    assert min(values) < 0 < max(values)
    run = forced("spikes", 12, Family("chi_square", "none", "constant", 1, "positive"))
    assert run.case.fault == "nan"  # batch-1 MSE noise: no spike within 50x stands out


def test_too_short_a_run_is_refused(capsys):
    with pytest.raises(ValueError, match="at least 500"):
        generate(Case(1, GAUSSIAN, "none", 100))
    assert main(["evaluate", "--families", "test", "--steps", "100"]) == 2
    assert "--steps >= 500" in capsys.readouterr().err


def test_evaluate_families_prints_spikeguard_beside_six_sigma_and_robust_z(capsys):
    assert main(["evaluate", "--families", "test", "--runs", "1", "--steps", "500"]) == 0
    out = capsys.readouterr().out
    assert "test half" in out
    for name in ("spikeguard", "six_sigma", "robust_z"):
        assert out.count(f" {name} ") >= 2, name  # in the scores and in the false actions
    assert "false actions per 10k steps" in out


def test_a_slow_divergence_is_labelled_only_where_the_loss_goes_up():
    """A label nobody can earn measures nothing: on a near-zero loss that falls x100 while the
    fault lifts it x2-5 over its curve, the loss only falls more slowly (no rule that does not
    know the curve can see it), so the run has no label; on a flat curve it rises, and has."""
    for seed in (42, 72):  # development seeds whose near-zero loss falls through the fault
        case = case_of(seed, 4000, "slow_divergence")
        run = generate(case)
        assert case.family.kind == "near_zero" and not any(lab.label for lab in run.labels)
        late = [e.loss for e in run.events[-2000:]]
        assert np.median(late[-200:]) < np.median(late[:200])  # it fell through the fault
    run = forced("slow_divergence", 6, GAUSSIAN, steps=4000)  # a constant LR: a flat curve
    labelled = [i for i, lab in enumerate(run.labels) if lab.label]
    assert labelled and {run.labels[i].kind for i in labelled} == {"slow_divergence"}
    before = np.median([e.loss for e in run.events[labelled[0] - 300 : labelled[0]]])
    assert np.median([e.loss for e in run.events[-100:]]) > 1.5 * before
