"""The recovery benchmark keeps working: its JSON contract, and strategies that do what they say.

The end-to-end test runs the benchmark script itself on its ``--tiny``
configuration (a real transformer, the real embedded pipeline), so a broken
strategy, a broken fault or a broken contract shows here, not in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from recovery_baselines import (  # noqa: E402
    RESTART_ONLY,
    LightningSpike,
    OlmoSkipStep,
    PalmManual,
    Restart,
    ZClip,
    SKIP,
    UPDATE,
    never_fires,
    run_baseline,
)
from recovery_faults import Fault  # noqa: E402
from recovery_setup import TINY, build  # noqa: E402

KEYS = {
    "fault",
    "strategy",
    "final_eval_loss",
    "wasted_steps",
    "rollbacks",
    "ci95",
    "goodput",
    "actions",
    "per_seed",
}
FAULTS = ("nan_batch", "overflow", "healthy")


@pytest.fixture(scope="module")
def tiny_run() -> dict:
    python = os.environ.get("SPIKEGUARD_PYTHON", sys.executable)
    done = subprocess.run(
        [
            python,
            str(BENCH / "bench_recovery.py"),
            "--tiny",
            "--json",
            "--faults",
            ",".join(FAULTS),
            "--strategies",
            "none,lightning_spike,palm_manual,spikeguard",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=BENCH.parent,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(report: dict, fault: str, strategy: str) -> dict:
    (row,) = [r for r in report["results"] if r["fault"] == fault and r["strategy"] == strategy]
    return row


def test_json_contract(tiny_run: dict) -> None:
    assert set(tiny_run) == {"clean", "clean_ci95", "seeds", "results"}
    assert isinstance(tiny_run["clean"], float) and math.isfinite(tiny_run["clean"])
    assert tiny_run["seeds"] == [0]  # --tiny: one seed unless --seeds says more
    pairs = [(r["fault"], r["strategy"]) for r in tiny_run["results"]]
    assert pairs == [
        (f, s) for f in FAULTS for s in ("none", "lightning_spike", "palm_manual", "spikeguard")
    ]
    for row in tiny_run["results"]:
        assert set(row) == KEYS
        assert isinstance(row["wasted_steps"], int) and row["wasted_steps"] >= 0
        assert isinstance(row["rollbacks"], int) and row["rollbacks"] >= 0
        assert isinstance(row["final_eval_loss"], float) or row["final_eval_loss"] in (
            "NaN",
            "Infinity",
        )
        assert 0.0 <= row["goodput"] <= 1.0 and len(row["per_seed"]) == 1 and len(row["ci95"]) == 2


def test_a_healthy_run_gets_no_action_and_full_goodput(tiny_run: dict) -> None:
    guarded = _row(tiny_run, "healthy", "spikeguard")
    assert guarded["actions"] == 0 and guarded["rollbacks"] == 0 and guarded["wasted_steps"] == 0
    assert guarded["goodput"] == 1.0
    assert guarded["final_eval_loss"] == _row(tiny_run, "healthy", "none")["final_eval_loss"]


def test_a_nan_batch_the_guard_skipped_costs_spikeguard_one_update_not_a_rollback(
    tiny_run: dict,
) -> None:
    guarded = _row(tiny_run, "nan_batch", "spikeguard")
    assert guarded["rollbacks"] == 0 and guarded["wasted_steps"] == 1
    assert guarded["wasted_steps"] < _row(tiny_run, "nan_batch", "palm_manual")["wasted_steps"]


def test_mean_and_interval_over_seeds_and_the_paired_verdict() -> None:
    from bench_recovery import mean_ci, verdicts

    mean, lo, hi = mean_ci([1.0, 2.0, 3.0])
    assert mean == 2.0 and (lo, hi) == pytest.approx(
        (2.0 - 4.303 / math.sqrt(3), 2.0 + 4.303 / math.sqrt(3))
    )
    assert math.isnan(mean_ci([1.0, float("nan")])[0])

    def row(strategy, losses, wasted=0, actions=0):
        return {
            "fault": "f",
            "strategy": strategy,
            "final_eval_loss": sum(losses) / len(losses),
            "per_seed": losses,
            "wasted_steps": wasted,
            "actions": actions,
        }

    # Paired by seed: spikeguard is worse on every seed by 0.01, with seeds far apart: not within.
    worse = [row("zclip", [2.0, 2.5, 3.0]), row("spikeguard", [2.01, 2.51, 3.01])]
    assert "beyond the 95% interval" in verdicts(2.0, worse)["f"]
    mixed = [row("zclip", [2.0, 2.5, 3.0]), row("spikeguard", [2.01, 2.49, 3.005])]
    assert "beyond" not in verdicts(2.0, mixed)["f"]


def test_nan_batch_ruins_an_unguarded_run_and_not_a_guarded_one(tiny_run: dict) -> None:
    assert _row(tiny_run, "nan_batch", "none")["final_eval_loss"] == "NaN"
    for strategy in ("lightning_spike", "palm_manual", "spikeguard"):
        row = _row(tiny_run, "nan_batch", strategy)
        assert isinstance(row["final_eval_loss"], float), strategy
        assert row["final_eval_loss"] < tiny_run["clean"] * 1.05, strategy
    lightning = _row(tiny_run, "nan_batch", "lightning_spike")
    assert lightning["rollbacks"] == 1 and lightning["wasted_steps"] > 0
    palm = _row(tiny_run, "nan_batch", "palm_manual")
    assert palm["rollbacks"] == 1 and palm["wasted_steps"] >= TINY.palm_skip


def test_overflow_burst_costs_every_run_its_skipped_updates(tiny_run: dict) -> None:
    none = _row(tiny_run, "overflow", "none")
    assert isinstance(none["final_eval_loss"], float)
    assert (
        none["wasted_steps"] == TINY.overflow_batches
    )  # every overflow is an update the scaler skipped
    guarded = _row(
        tiny_run, "overflow", "spikeguard"
    )  # a rollback under a GradScaler keeps the run going
    assert (
        isinstance(guarded["final_eval_loss"], float)
        and guarded["final_eval_loss"] < tiny_run["clean"] * 1.05
    )


def test_olmo_skip_step_skips_a_six_sigma_loss_and_nan() -> None:
    rule = OlmoSkipStep()
    gen = torch.Generator().manual_seed(0)
    for step in range(100):
        noise = torch.rand(2, generator=gen).tolist()
        assert rule.judge(step, step, 2.0 + 0.01 * noise[0], 1.0 + 0.01 * noise[1], []) == UPDATE
    assert rule.judge(100, 100, 2.5, 1.0, []) == SKIP
    assert rule.judge(101, 101, 2.0, 5.0, []) == SKIP
    assert rule.judge(102, 102, float("nan"), 1.0, []) == SKIP
    assert rule.judge(103, 103, 2.005, 1.005, []) == UPDATE


def test_zclip_clips_an_outlier_norm_to_its_adaptive_bound() -> None:
    clip = ZClip()
    gen = torch.Generator().manual_seed(0)
    for step in range(60):
        clip.judge(
            step, step, 2.0, 1.0 + 0.05 * float(torch.randn(1, generator=gen)), [torch.ones(1)]
        )
    grads = [torch.full((4,), 5.0)]  # norm 10: far above ~1 +- 0.05
    mean, std, before = clip.mean, math.sqrt(clip.var), clip.clipped
    clip.judge(60, 60, 2.0, 10.0, grads)
    z = (10.0 - mean) / std
    assert float(torch.linalg.vector_norm(grads[0])) == pytest.approx(
        mean + 2.5 / z * std, rel=1e-4
    )
    assert clip.clipped == before + 1


def test_lightning_spike_restarts_on_a_tripled_loss_and_skips_two_batches() -> None:
    rule = LightningSpike()
    for step in range(20):
        assert rule.judge(step, step + 100, 2.0, 1.0, []) == UPDATE
    verdict = rule.judge(20, 120, 7.0, 1.0, [])
    assert isinstance(verdict, Restart) and verdict.before == 20 and verdict.skip == (119, 120)
    rule.restarted()
    assert rule.judge(20, 121, 2.5, 1.0, []) == UPDATE  # fresh detector: warm-up first


def test_palm_manual_goes_back_and_does_not_react_to_noise() -> None:
    rule = PalmManual(back=100, skip=200)
    for step in range(50):
        assert rule.judge(step, step, 2.0 + 0.1 * (step % 3), 1.0, []) == UPDATE
    verdict = rule.judge(150, 150, 3.0, 1.0, [])
    assert isinstance(verdict, Restart) and verdict.before == 50


def test_bad_shard_corrupts_only_its_window_and_the_same_way_twice() -> None:
    fault = Fault("bad_shard", TINY, seed=0)
    x = torch.arange(64).reshape(2, 32)
    y = x + 1
    assert torch.equal(fault.batch(TINY.fault_step - 1, x, y)[1], y)
    first = fault.batch(TINY.fault_step, x, y)[1]
    assert not torch.equal(first, y) and torch.equal(
        first.flatten().sort().values, y.flatten().sort().values
    )
    assert torch.equal(
        fault.batch(TINY.fault_step, x, y)[1], first
    )  # a re-run meets the same bad batch


@pytest.mark.heavy
def test_a_restart_only_rule_that_never_fires_on_the_none_run_is_that_run_exactly() -> None:
    """Why the benchmark trains lightning_spike and palm_manual only where their rule fires:
    trained anyway, a silent one gives the none run's numbers to the last digit."""

    def run(fault: str, strategy: str) -> dict:
        return run_baseline(build(0, TINY, fault), Fault(fault, TINY, 0), strategy, TINY, 0)

    none = run("healthy", "none")
    assert len(none["trace"]) == TINY.steps
    for strategy in RESTART_ONLY:
        assert never_fires(strategy, TINY, none["trace"])
        trained = run("healthy", strategy)
        keep = ("final_eval_loss", "wasted_steps", "rollbacks", "goodput", "steps_done")
        assert {k: trained[k] for k in keep} == {k: none[k] for k in keep}
    # A NaN batch fires both (a non-finite loss is a spike to each): they must be trained.
    nan = run("nan_batch", "none")
    assert not any(never_fires(strategy, TINY, nan["trace"]) for strategy in RESTART_ONLY)
    with pytest.raises(ValueError, match="acts on every step"):
        never_fires("zclip", TINY, none["trace"])


@pytest.mark.heavy
def test_a_replayed_data_path_is_the_run_it_was_recorded_from() -> None:
    """`--same-path` says what a guarded run's rollbacks and skips cost by themselves: the plain
    loop replaying a recorded path (restarts at the same steps, the same skip windows and
    skipped updates, no judgement) must be that run, or the comparison means nothing."""
    from recovery_baselines import SamePath

    def run(strategy: str, rule=None) -> dict:
        return run_baseline(
            build(0, TINY, "nan_batch"), Fault("nan_batch", TINY, 0), strategy, TINY, 0, rule
        )

    for strategy in RESTART_ONLY:  # each restarts at the NaN batch and skips from there
        recorded = run(strategy)
        assert recorded["rollbacks"] >= 1 and recorded["path"]["rollbacks"][0]["skip"]
        replayed = run("same_path", SamePath(recorded["path"]))
        assert replayed["final_eval_loss"] == recorded["final_eval_loss"], strategy
        assert replayed["skipped_batches"] == recorded["skipped_batches"]
        assert replayed["rerun_steps"] == recorded["rerun_steps"]
    # Without the recorded restart and skips the NaN batch ruins the run: the replay did them.
    assert math.isnan(run("none")["final_eval_loss"])


@pytest.mark.heavy
def test_a_guarded_run_that_only_skipped_an_update_is_the_plain_loop_with_that_skip() -> None:
    """The Guard's presence changes nothing but what it decides: its NaN run, replayed in the
    plain loop with the one update it skipped, ends at its eval loss to the bit."""
    from recovery_baselines import SamePath
    from recovery_guarded import open_bench_runtime, run_spikeguard

    torch.set_num_threads(1)
    runtime = open_bench_runtime()
    try:
        guarded = run_spikeguard(
            build(0, TINY, "nan_batch"), Fault("nan_batch", TINY, 0), TINY, 0, runtime
        )
    finally:
        runtime.close()
    assert guarded["path"] == {"rollbacks": [], "skipped_updates": [TINY.fault_step]}
    replayed = run_baseline(
        build(0, TINY, "nan_batch"),
        Fault("nan_batch", TINY, 0),
        "same_path",
        TINY,
        0,
        SamePath(guarded["path"]),
    )
    assert replayed["final_eval_loss"] == guarded["final_eval_loss"]
