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
#: Kinds on which the default pipeline still acts falsely; each is a known gap, not an allowance.
KNOWN_FALSE_ACTIONS = {
    # A long linear warm-up (1,000 steps to 3e-3) makes the loss swing x2-3 between steps 330
    # and 440: two-point loss spikes, answered with LR cuts (5 in 5,000 steps).
    "warmup": "loss spikes during a long warm-up are answered with LR cuts",
}


@pytest.mark.parametrize("kind", [
    pytest.param(k, marks=pytest.mark.xfail(strict=True, reason=KNOWN_FALSE_ACTIONS[k]))
    if k in KNOWN_FALSE_ACTIONS else k for k in KINDS])
def test_a_healthy_kind_gets_no_false_action(kind):
    (run,) = healthy_kinds([HEALTHY / f"{kind}.csv"])[kind]
    found = pipeline_false_actions([run.events])
    assert found.steps == 5000
    assert (found.stops, found.rollbacks, found.lr_cuts, found.skipped_batches) == (0, 0, 0, 0), found
    assert found.local_skips <= 0.005 * found.steps, found


def test_the_suite_has_every_kind_of_healthy_run():
    assert len(KINDS) == 11 and {"regression_b1", "classification_noisy_b1", "warm_restarts", "char_lm"} <= set(KINDS)
