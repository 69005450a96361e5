"""Done means: three real trainings per fault, one seed — clean, faulty guarded, faulty unguarded.

The guarded run ends within 2 % of the clean run's evaluation loss, the
unguarded one at least 20 % worse (or non-finite), and the guarded run never
applied an optimizer update with a non-finite gradient. The whole pipeline
(detectors, fusion, policy) runs on the embedded bus via open_runtime(), recording
into a data directory: ``spikeguard replay`` with the recorded settings reproduces
that recording exactly (a rollback, then LR restores: the actuator must hear the
trainer's acks).
"""

from __future__ import annotations

import math

import pytest

from spikeguard.cli import main
from spikeguard.demo.run import DEMO_SETTINGS, run_demo
from spikeguard.runtime import open_runtime
from spikeguard.settings import load_settings

SEED = 0


@pytest.fixture(scope="module")
def clean():
    outcome = run_demo("none", seed=SEED, guarded=False)
    assert math.isfinite(outcome.final_eval_loss)
    return outcome.final_eval_loss


@pytest.mark.parametrize("fault", ["spike", "nan", "divergence"])
def test_guarded_run_ends_as_good_as_a_clean_run(fault, clean, tmp_path, capsys):
    recording = tmp_path / "rec"
    with open_runtime(
        load_settings({**DEMO_SETTINGS, "data_dir": str(recording)}, env={})
    ) as runtime:
        guarded = run_demo(fault, seed=SEED, guarded=True, runtime=runtime)
    unguarded = run_demo(fault, seed=SEED, guarded=False)
    print(
        f"{fault}: clean {clean:.4f} guarded {guarded.final_eval_loss:.4f} "
        f"unguarded {unguarded.final_eval_loss:.4f} actions {guarded.actions_applied}"
    )
    assert guarded.steps == unguarded.steps == 300
    assert abs(guarded.final_eval_loss - clean) <= 0.02 * clean
    bad = unguarded.final_eval_loss
    assert not math.isfinite(bad) or bad >= 1.2 * clean
    assert guarded.nonfinite_updates == 0
    assert guarded.incidents >= 1 and guarded.rollbacks >= 1
    # The data caused the spike and the NaN: skipped. The LR blow-up's data was fine: kept.
    assert (guarded.skipped_batches > 0) == (fault != "divergence")
    # In proportion: the fault spans 3 batches; the skip stays within max_skip_share (5 %) of the
    # run even without the budget's floor (it skipped 44 of 300 when the demo set 40 extra).
    assert guarded.skipped_batches <= 0.05 * guarded.steps, guarded.skipped_batches
    if fault == "divergence":
        return
    capsys.readouterr()
    assert main(["replay", "--data-dir", str(recording)]) == 0
    out = capsys.readouterr().out
    assert "judged with the recorded settings" in out
    assert "decisions: 0 added, 0 removed, 0 changed" in out, out
    assert "actions: 0 added, 0 removed, 0 changed" in out, out
    assert "no differences" in out, out
