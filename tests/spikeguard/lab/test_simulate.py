"""The synthetic run generator: determinism, labels that mean what they say, variety."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spikeguard.lab import scenarios
from spikeguard.lab.evaluation import episodes_from_labels
from spikeguard.lab.simulate import (
    ANOMALY_KINDS,
    SCENARIOS,
    default_suite,
    generate,
)

CLASSIC = ("stable", "gradual_spike", "sudden_spike", "oscillation", "non_finite")
BENIGN = ("heavy_tailed", "data_shift", "eval_bumps")


def _losses(run):
    return np.array([e.loss for e in run.events])


def _episodes(run):
    return episodes_from_labels([e.step for e in run.events], run.labels)


def test_the_classic_scenarios_and_the_realistic_ones_exist():
    assert set(CLASSIC) <= set(SCENARIOS)
    assert {"divergence", "grad_explosion", *BENIGN} <= set(SCENARIOS)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_scenario_is_deterministic_and_complete(name):
    a, b = generate(name, 1500, seed=3), generate(name, 1500, seed=3)
    assert [e.model_dump_json() for e in a.events] == [e.model_dump_json() for e in b.events]
    assert a.labels == b.labels
    assert len(a.events) == len(a.labels) == 1500
    steps = [e.step for e in a.events]
    assert steps == list(range(steps[0], steps[0] + 1500))
    assert all(
        e.loss is not None and e.grad_norm is not None and e.lr is not None for e in a.events
    )
    assert all(e.lr > 0 for e in a.events)
    assert a.run_id == f"sim-{name}-s3-n1500"
    other = generate(name, 1500, seed=4)
    assert not np.array_equal(_losses(a), _losses(other))


@pytest.mark.parametrize("name", ["stable", *BENIGN])
def test_clean_scenarios_have_no_labelled_step(name):
    for seed in range(3):
        run = generate(name, 3000, seed)
        assert not any(lab.label for lab in run.labels)
        assert all(math.isfinite(e.loss) and math.isfinite(e.grad_norm) for e in run.events)


@pytest.mark.parametrize(
    "name",
    ["sudden_spike", "gradual_spike", "divergence", "oscillation", "non_finite", "grad_explosion"],
)
def test_anomaly_scenarios_label_their_kind(name):
    for seed in range(3):
        kinds = {e.kind for e in _episodes(generate(name, 3000, seed))}
        assert name in kinds
        assert kinds <= set(ANOMALY_KINDS)


def test_benign_events_are_marked_but_not_labelled():
    kinds = {lab.kind for s in BENIGN for lab in generate(s, 4000, 1).labels if lab.kind}
    assert {"benign_blip", "benign_data_shift", "benign_eval_bump"} <= kinds
    for name in BENIGN:
        run = generate(name, 4000, 1)
        assert all(not lab.label for lab in run.labels if lab.kind.startswith("benign_"))


@pytest.mark.heavy
def test_sudden_spikes_are_big_and_benign_blips_are_not():
    """Labelled spikes start at >= x1.5 the recent level; blips stay within the real-data envelope."""
    ratios, blips = [], []
    for seed in range(6):
        run = generate("sudden_spike", 4000, seed)
        loss = _losses(run)
        for e in _episodes(run):
            i = e.start - run.events[0].step
            ratios.append(loss[i] / np.median(loss[i - 30 : i]))
        for i, lab in enumerate(run.labels):
            if lab.kind == "benign_blip" and i > 40 and run.labels[i - 1].kind != "benign_blip":
                blips.append(loss[i] / np.median(loss[i - 30 : i]))
    assert len(ratios) >= 6 and min(ratios) > 1.4
    assert max(ratios) > 3  # sizes vary up to x10
    assert blips and max(blips) < 2.3


def test_non_finite_labels_match_non_finite_values():
    for seed in range(4):
        run = generate("non_finite", 3000, seed)
        for event, lab in zip(run.events, run.labels):
            bad = not (math.isfinite(event.loss) and math.isfinite(event.grad_norm))
            assert bad == (lab.kind == "non_finite"), (seed, event.step)
            assert lab.label or not bad
    values = {
        str(e.loss)
        for s in range(6)
        for e in generate("non_finite", 3000, s).events
        if not math.isfinite(e.loss)
    }
    assert {"nan", "inf"} <= values


def test_grad_explosions_start_with_a_huge_gradient_norm():
    run = generate("grad_explosion", 4000, 2)
    grad = np.array([e.grad_norm for e in run.events])
    first = run.events[0].step
    for e in _episodes(run):
        if e.kind == "grad_explosion":
            i = e.start - first
            assert grad[i] > 10 * np.median(grad[i - 100 : i - 80])


@pytest.mark.heavy
def test_runs_vary_in_scale_noise_and_schedule():
    runs = [generate("stable", 1000, seed) for seed in range(24)]
    starts = [r.events[0].loss for r in runs]
    ends = [np.median(_losses(r)[-50:]) for r in runs]
    assert min(ends) < 1.0 and max(starts) > 9.0
    sigmas = [r.params["sigma"] for r in runs]
    assert max(sigmas) / min(sigmas) > 3
    assert len({r.params["schedule"] for r in runs}) >= 3
    assert any(r.events[0].update_norm is None for r in runs)
    assert any(r.events[0].update_norm is not None for r in runs)


def test_noise_is_calibrated_like_real_logs():
    """Robust log-noise sigma near the drawn value, heavy but not absurd tails."""
    run = generate("stable", 6000, 5)
    logs = np.log(_losses(run))
    resid = logs[1000:] - np.convolve(logs, np.ones(31) / 31, mode="same")[1000:]
    resid = resid[:-20]
    mad_sigma = 1.4826 * np.median(np.abs(resid - np.median(resid)))
    assert 0.7 < mad_sigma / run.params["sigma"] < 1.5
    assert np.abs(resid).max() < math.log(2.1)


def test_default_suite_is_varied_and_modest():
    suite = default_suite()
    assert {item.scenario for item in suite} == set(SCENARIOS)
    total = sum(item.steps for item in suite)
    assert 150_000 <= total <= 300_000
    assert len({item.steps for item in suite}) > 20
    assert default_suite() == suite
    assert default_suite(seeds=[0], scenarios=["stable"]) == [
        item for item in suite if item.scenario == "stable" and item.seed == 0
    ]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown scenario"):
        generate("nope", 1000, 0)
    with pytest.raises(ValueError, match="at least"):
        generate("stable", 50, 0)


def test_spike_size_respects_the_noise_floor():
    rng = np.random.default_rng(0)
    n = 500
    canvas = scenarios.Canvas(
        rng,
        np.full(n, math.log(3.0)),
        np.full(n, 0.05),
        np.zeros(n),
        np.zeros(n),
        np.full(n, 1e-3),
        earliest=100,
    )
    sizes = [canvas.spike_size(200) for _ in range(200)]
    assert min(sizes) >= scenarios.SPIKE_Z_MIN * 0.05  # noisy run: well above any blip
    assert max(sizes) <= math.log(scenarios.SPIKE_MAX) + 1e-9


def test_persistent_spike_profiles_stay_up():
    rng = np.random.default_rng(1)
    for _ in range(50):
        profile = scenarios.spike_profile(rng, 2.0, persistent=True)
        assert profile[0] == 2.0 and len(profile) >= 5 and (profile[:5] >= 0.7 * 2.0 - 1e-9).all()
    shapes = [len(scenarios.spike_profile(rng, 1.0)) for _ in range(100)]
    assert min(shapes) <= 2 and max(shapes) > 50  # transient ones heal at once, others linger
