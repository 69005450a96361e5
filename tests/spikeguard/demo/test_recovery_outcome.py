"""Done means: three real trainings per fault, one seed — clean, faulty guarded, faulty unguarded.

The guarded run ends within 2 % of the clean run's evaluation loss, the
unguarded one at least 20 % worse (or non-finite), and the guarded run never
applied an optimizer update with a non-finite gradient. The whole pipeline
(detectors, fusion, policy) runs on the embedded bus via open_runtime().
"""

from __future__ import annotations

import math

import pytest

from spikeguard.demo.run import run_demo

SEED = 0


@pytest.fixture(scope="module")
def clean():
    outcome = run_demo("none", seed=SEED, guarded=False)
    assert math.isfinite(outcome.final_eval_loss)
    return outcome.final_eval_loss


@pytest.mark.parametrize("fault", ["spike", "nan", "divergence"])
def test_guarded_run_ends_as_good_as_a_clean_run(fault, clean):
    guarded = run_demo(fault, seed=SEED, guarded=True)
    unguarded = run_demo(fault, seed=SEED, guarded=False)
    print(f"{fault}: clean {clean:.4f} guarded {guarded.final_eval_loss:.4f} "
          f"unguarded {unguarded.final_eval_loss:.4f} actions {guarded.actions_applied}")
    assert guarded.steps == unguarded.steps == 300
    assert abs(guarded.final_eval_loss - clean) <= 0.02 * clean
    bad = unguarded.final_eval_loss
    assert not math.isfinite(bad) or bad >= 1.2 * clean
    assert guarded.nonfinite_updates == 0
    assert guarded.incidents >= 1 and guarded.rollbacks >= 1
    # The data caused the spike and the NaN: skipped. The LR blow-up's data was fine: kept.
    assert (guarded.skipped_batches > 0) == (fault != "divergence")
