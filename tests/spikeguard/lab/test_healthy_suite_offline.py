"""The checked-in healthy-run suite (data/healthy), offline through the whole pipeline and policy.

Every kind is a healthy run: any stop, rollback, LR change or batch skip the policy would take is a
false action, and the Guard's own update skips must stay at or below 0.5 % of the steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spikeguard.lab.false_actions import pipeline_false_actions
from spikeguard.lab.realdata import healthy_kinds

HEALTHY = Path(__file__).resolve().parents[3] / "data" / "healthy"
KINDS = sorted(p.stem for p in HEALTHY.glob("*.csv"))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.heavy
def test_a_healthy_kind_gets_no_false_action(kind):
    (run,) = healthy_kinds([HEALTHY / f"{kind}.csv"])[kind]
    found = pipeline_false_actions([run.events])
    assert found.steps == 5000
    assert (found.stops, found.rollbacks, found.lr_cuts, found.skipped_batches) == (0, 0, 0, 0), (
        found
    )
    assert found.local_skips <= 0.005 * found.steps, found


def test_the_suite_has_every_kind_of_healthy_run():
    assert len(KINDS) == 16 and {
        "regression_b1",
        "regression_heavy_b1",  # Student-t targets: one batch in thousands x1000 its median
        "near_zero_cnn",  # the loss falls towards 1e-4, with hard batches x1000 that
        "poisson_b4",  # the loss falls through zero to about -20
        "gaussian_nll",  # the loss falls from ~1 to about -0.9
        "hinge_b8",  # the loss (and the gradient) is exactly zero on ~95 % of the batches
        "classification_noisy_b1",
        "warm_restarts",
        "char_lm",
    } <= set(KINDS)


#: Seeds the rules for losses below zero or at zero were not developed on (the CSVs are seed 0;
#: the hinge was also looked at with seed 1): the check the README names, trained afresh.
HELD_OUT_SEEDS = [("poisson_b4", 1), ("gaussian_nll", 1), ("hinge_b8", 2)]


@pytest.mark.parametrize("kind, seed", HELD_OUT_SEEDS)
@pytest.mark.heavy
def test_a_held_out_seed_of_a_signed_or_zero_kind_gets_no_false_action(kind, seed):
    import torch

    from spikeguard.lab.healthy_runs import record
    from spikeguard.schemas import StepEvent

    torch.set_num_threads(1)
    events = [
        StepEvent(run_id=kind, step=r.step, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr, time=0.0)
        for r in record(kind, 5000, seed)
    ]
    found = pipeline_false_actions([events])
    assert (found.stops, found.rollbacks, found.lr_cuts, found.skipped_batches) == (0, 0, 0, 0), (
        found
    )
    assert found.local_skips <= 0.005 * found.steps, found
