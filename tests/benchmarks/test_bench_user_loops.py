"""Issue 38 on real loops: a data fault of a few batches costs a guarded run in proportion, and an
LR blow-up that damaged the model is rolled back.

The loop is the user-loops benchmark's GRU encoder-decoder with the README's
five lines and the default policy: five consecutive batches with shuffled
labels in a 600-step run whose LR decays to 0.1x over its last tenth (at a
constant LR this loop's last-step eval swings by tens of % with any 8 batches
left out, so "within 3 %" could not be read from it). The skip must stay within
``max_skip_share`` (5 %, 30 batches) and the run within 3 % of the clean one
and no worse than the unguarded one. The benchmark holds the same over 10+
seeds (docs/benchmarks.md); this is its cheap configuration, one seed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from bench_user_loops import LoopConfig, _schedule, paired, run, sign_p  # noqa: E402

CFG = LoopConfig(steps=600, fault_step=300)  # constant LR: the LR blow-up tests' schedule
DECAYED = LoopConfig(steps=600, fault_step=300, decay_share=0.1)


def test_the_lr_falls_to_a_tenth_over_the_last_tenth_and_is_constant_before() -> None:
    decayed = _schedule(LoopConfig(steps=1000, decay_share=0.1), "data")
    assert [decayed(s) for s in (100, 500, 899, 900)] == [1.0, 1.0, 1.0, 1.0]
    falling = [decayed(s) for s in range(900, 1000)]
    assert all(a > b for a, b in zip(falling, falling[1:]))
    assert falling[-1] == pytest.approx(0.1)
    assert _schedule(LoopConfig(), "data")(1999) == 1.0  # the quick tests' constant schedule


def test_the_paired_table_compares_each_seed_with_its_own_clean_and_unguarded_runs() -> None:
    def r(mode: str, seed: int, value: float, **more: Any) -> dict[str, Any]:
        fault = "none" if mode == "clean" else "data"
        return {"loop": "cnn", "fault": fault, "mode": mode, "seed": seed, "eval": value, **more}

    guarded = {"skipped_batches": 8, "rerun_steps": 104, "steps": 1000, "same_data_eval": 1.1}
    runs = [r("clean", s, 1.0) for s in range(3)] + [r("unguarded", s, 2.0) for s in range(3)]
    runs += [r("guarded", 0, 1.01, **guarded), r("guarded", 1, 0.9, **guarded)]
    runs += [r("guarded", 2, 2.2, **guarded)]
    row = paired(runs, "cnn", "data", "eval")
    assert row["seeds"] == [0, 1, 2]
    assert row["guarded_vs_clean"] == (1.01, 0.9, 2.2)  # median, min, max
    assert row["guarded_vs_unguarded"] == (0.505, 0.45, 1.1)
    assert row["same_data_vs_clean"] == pytest.approx((1.1, 1.1, 1.1))
    assert row["signs"] == (2, 0, 1)  # better, equal, worse than unguarded
    assert row["skipped_share_max"] == 0.008
    assert sign_p(1, 2) == 1.0
    assert sign_p(0, 10) == pytest.approx(2 / 1024)


@pytest.fixture(scope="module")
def data_fault() -> dict[str, dict[str, Any]]:
    """The seq2seq loop under the data fault: clean, unguarded and guarded (run once, shared)."""
    return {
        mode: run("seq2seq", "data", mode, 0, DECAYED) for mode in ("clean", "unguarded", "guarded")
    }


@pytest.mark.heavy
def test_a_few_bad_batches_skip_in_proportion_and_end_near_clean(
    data_fault: dict[str, dict[str, Any]],
) -> None:
    clean, unguarded, guarded = (data_fault[m] for m in ("clean", "unguarded", "guarded"))
    assert "skip_batches" in guarded["actions"], guarded["summary"]  # the fault was answered
    # ... by removing the data: the optimizer was never unstable, so LR and clipping are kept
    assert not {"scale_lr", "clip"} & set(guarded["actions"]), guarded["summary"]
    assert guarded["skipped_batches"] <= 0.05 * DECAYED.steps, guarded["summary"]
    # 0.1946 against clean 0.1893 (+2.8 %: leaving 8 batches out) and unguarded 0.2118
    assert guarded["eval"] <= clean["eval"] * 1.03, (clean, guarded)
    assert guarded["eval"] <= unguarded["eval"], (unguarded, guarded)


@pytest.mark.heavy
def test_a_rolled_back_run_ends_where_the_loop_reading_the_batches_it_kept_ends(
    data_fault: dict[str, dict[str, Any]],
) -> None:
    """Issue 38's "guarded worse than its fault explains" (seq2seq, seed 10: 0.1332 against
    0.0785 unguarded) was this to the bit: the clean loop without batches 1000..1007 ends at
    0.1332. A rollback restores weights, Adam's moments and step, the schedule and the data order
    exactly, and the re-read of the data past the skip window is the unguarded loop's own order, so
    the unguarded loop that leaves out the skipped batches ends with the same eval, exactly. Any
    state the rollback failed to restore (or a re-read in another order) shows here."""
    guarded = data_fault["guarded"]
    assert guarded["actions"].count("rollback") == 1, guarded["summary"]
    assert guarded["skip_ranges"], guarded["summary"]
    same_data = run(
        "seq2seq",
        "data",
        "unguarded",
        0,
        DECAYED,
        guarded["skip_ranges"],
        guarded["skipped_updates"],
    )
    assert guarded["eval"] == same_data["eval"], (guarded, same_data)
    # ... at every point of the tail too (evals taken during the re-run replace the first run's)
    assert guarded["tail_eval"] == same_data["tail_eval"], (guarded, same_data)


@pytest.mark.heavy
def test_an_lr_blowup_that_damaged_the_model_is_rolled_back_to_before_it() -> None:
    """LR x50 for 100 steps from step 300 of the GRU encoder-decoder (issue 38): the model is
    damaged before the scale-back can help. Rolled back once to before the jump, no data skipped
    (the data is fine), and the re-run holds the schedule's jump at the rate the run trained at,
    giving the schedule back exactly when it comes down (HOLD_LR). x0.1 alone left it at 0.93
    (clean 0.29, unguarded 1.76); the rollback with x0.1 at once on the re-run and x1.25 restores
    per 200 steps at 0.67, ending at 0.1x its schedule; with the hold 0.26, at 1.0x."""
    unguarded = run("seq2seq", "lr_blowup", "unguarded", 0, CFG)
    guarded = run("seq2seq", "lr_blowup", "guarded", 0, CFG)
    # Once on a quiet machine; the embedded pipeline's actions come later on a loaded one, and the
    # re-run's jump may then need a rollback of its own before its scale-back lands.
    assert guarded["actions"].count("rollback") >= 1, guarded["summary"]
    assert "skip_batches" not in guarded["actions"], guarded["summary"]
    assert "hold_lr" in guarded["actions"], guarded["summary"]
    assert guarded["lr_factor_at_end"] == pytest.approx(1.0), guarded["summary"]  # the schedule's
    assert guarded["eval"] <= unguarded["eval"], (unguarded, guarded)


@pytest.mark.heavy
def test_an_lr_blowup_answered_without_a_rollback_gives_the_schedule_back_when_it_ends() -> None:
    """The character GRU under LR x50 for 100 steps (issue 38): x0.1 then x1.25 per 200 healthy
    steps left it at 0.244x its schedule at the end of 2,000 steps, +7.3 % final loss. The jump
    now on is held by the trainer (HOLD_LR) and the schedule is given back the step it ends."""
    clean = run("char_lm", "lr_blowup", "clean", 0, CFG)
    guarded = run("char_lm", "lr_blowup", "guarded", 0, CFG)
    assert "hold_lr" in guarded["actions"], guarded["summary"]
    assert "scale_lr" not in guarded["actions"], guarded["summary"]
    assert guarded["lr_factor_at_end"] == pytest.approx(1.0), guarded["summary"]
    assert guarded["eval"] <= clean["eval"] * 1.03, (clean, guarded)


@pytest.mark.heavy
def test_a_cnns_few_bad_batches_are_rolled_back_though_its_loss_is_as_noisy_as_its_level() -> None:
    """The CNN of the user loops (seed 29 of the benchmark's development seeds, 1,000 steps): its
    batch loss is as noisy as its level, so the medians of the losses after its five bad batches
    rose by fewer than the four standard errors the damage test asks, and the fault was left in
    (+2.4 % of clean). On the mean of their logs (a positive loss's noise is a multiple of its
    level), the rise is found: rolled back, the bad batches skipped, within 3 % of clean."""
    cfg = LoopConfig(steps=1000, fault_step=500, decay_share=0.1)
    clean, unguarded, guarded = (
        run("cnn", "data", mode, 29, cfg) for mode in ("clean", "unguarded", "guarded")
    )
    assert {"rollback", "skip_batches"} <= set(guarded["actions"]), guarded["summary"]
    assert guarded["skipped_batches"] <= 0.05 * cfg.steps, guarded["summary"]
    assert guarded["eval"] <= clean["eval"] * 1.03, (clean, guarded)
    assert guarded["eval"] <= unguarded["eval"], (unguarded, guarded)
