"""The clipping a recovery set is given back with its LR once the cause is gone (issue 38: "clip
1.0 applied during a recovery stays for the rest of the run").

A real model trains on the embedded runtime (detectors, fusion, policy) in lockstep; a few
corrupted batches make a rollback that skips them, halves the LR and clips at 1. The optimizer's
own pre-step hook measures the gradients it is handed, so "clipped" is what it really sees.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from producers_helpers import lockstep_regression_guard, noisy_regression

from spikeguard.runtime import open_runtime
from spikeguard.settings import load_settings

pytestmark = pytest.mark.heavy

STEPS = 90
FAULT = range(60, 66)  # batches whose targets are garbage: a rollback to step 40, skip 60..67
# Read by the re-run at steps 62-63, on the batches after the skipped ones: two more bad batches
# (the Guard skips both updates, the pipeline calls the spike absorbed): trouble on the re-run.
AGAIN = (70, 71)
POLICY = {"rollback_min_steps_before_onset": 20}  # (a short run: the default is 100)


@pytest.fixture(scope="module")
def runtime():
    settings = load_settings({"topic_prefix": f"clip-{uuid.uuid4().hex[:8]}."}, env={})
    with open_runtime(settings) as rt:
        yield rt


def _train(runtime, tmp_path, spiked_step, run_id: str, bad: set[int]):
    """The guarded run, and per update: (step, epoch, the clip in force, the norm the optimizer saw)."""
    guard, model, optimizer = lockstep_regression_guard(runtime, tmp_path, run_id, POLICY)
    seen: list[tuple[int, int, float | None, float]] = []

    def measure(*_: object) -> None:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        seen.append((guard.step_count, guard.generation, guard.clipper.threshold(), float(norm)))

    optimizer.register_step_pre_hook(measure)
    for x, y in guard.data(noisy_regression(), epochs=10, max_steps=STEPS):
        spiked_step(guard, model, optimizer, x, y, bad)
    return guard, guard.close(), seen


def _lift_steps(guard) -> list[int]:
    return [
        a["step"]
        for a in guard.acks.applied
        if a["kind"] == "clip" and a["status"] == "applied" and "lifted" in a["result"]
    ]


def test_the_clip_is_lifted_once_the_re_run_passed_the_skipped_data(runtime, tmp_path, spiked_step):
    guard, summary, seen = _train(runtime, tmp_path, spiked_step, "clip-lifted", set(FAULT))
    assert guard.generation == 1 and summary.actions.get("clip") == 1, str(summary)
    [lifted_at] = _lift_steps(guard)
    clipped = [n for step, epoch, limit, n in seen if epoch == 1 and step < lifted_at]
    after = [(limit, n) for step, epoch, limit, n in seen if epoch == 1 and step >= lifted_at]
    assert clipped and max(clipped) <= 1.0 + 1e-4  # the re-run up to the lift: clipped at 1
    assert after and all(limit is None for limit, _ in after)  # no clipping in force after it
    assert max(n for _, n in after) > 1.5  # and the optimizer sees the gradients unclipped
    assert guard.clipper.max_norm is None and guard.lr.effective() == pytest.approx(0.05)
    assert "stay clipped" not in str(summary)
    assert f"The clipping a recovery set was lifted at step {lifted_at} (no clipping now)" in str(
        summary
    )


def test_a_re_run_that_meets_trouble_keeps_the_clip(runtime, tmp_path, spiked_step):
    guard, summary, seen = _train(runtime, tmp_path, spiked_step, "clip-kept", {*FAULT, *AGAIN})
    assert guard.generation == 1 and _lift_steps(guard) == [], str(summary)
    assert guard.clipper.threshold() == 1.0
    assert max(n for step, epoch, _, n in seen if epoch == 1) <= 1.0 + 1e-4
    assert "Gradients stay clipped at max_norm 1 (set by a recovery)" in str(summary)
