"""The ablation table on the real-spike fixture: each detector removed in turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from spikeguard.lab.ablation import ALL, ablate, configurations
from spikeguard.lab.realdata import load_spike_set

FIXTURES = Path(__file__).parents[2] / "data" / "real_spikes"


@pytest.mark.heavy
def test_each_detector_is_removed_once_and_the_statistical_one_carries_real_spikes():
    assert [c for c, _ in configurations()] == ["all"] + [f"-{n}" for n in ALL]
    runs = [("real-spikes", r.events, r.labels) for r in load_spike_set(FIXTURES)]
    rows = {(r["config"], r["set"]): r for r in ablate(runs)}
    # 7 of 8: the DLRM run's spike at point 34 is missed (see test_real_data); the outlier-step
    # marks on three unlabelled one-step jumps of +21-28 % are counted apart, as guard skips
    assert rows["all", "real-spikes"]["detected"] >= 7
    assert rows["all", "real-spikes (incidents)"]["precision"] == 1.0
    # without it only the non-finite steps and the extreme divergence are left
    assert rows["-statistical", "real-spikes"]["recall"] <= 0.25
    assert (
        rows["-ml", "real-spikes"]["recall"] == rows["all", "real-spikes"]["recall"]
    )  # ml adds nothing


@pytest.mark.heavy
def test_the_ml_detector_alone_catches_the_layer_blowups_and_adds_no_false_alarm():
    from spikeguard.lab.ablation import contributions
    from spikeguard.lab.layer_runs import layer_set

    runs = [
        (group, r.events, r.labels if r.layer else None) for group, r in layer_set((1,), steps=600)
    ]
    rows = {(r["config"], r["set"]): r for r in ablate(runs)}
    assert rows["all", "layer-blowup"]["detected"] == rows["all", "layer-blowup"]["episodes"] == 2
    # no false incident; a one-step outlier mark (a Guard skip, counted apart as above) may occur
    assert rows["all", "layer-blowup (incidents)"]["false_alarms"] == 0
    assert rows["all", "layer-healthy (incidents)"]["false_alarms"] == 0
    assert rows["all", "layer-healthy"]["false_alarms"] <= 1
    # a layer-local blow-up is the layer model's; the gradient norm's outlier model sees one of them
    assert rows["-ml", "layer-blowup"]["detected"] <= 1
    for other in ("statistical", "rules", "predictor"):
        assert rows[f"-{other}", "layer-blowup"]["detected"] == 2
    adds = {(c["detector"], c["set"]): c for c in contributions(list(rows.values()))}
    assert adds["ml", "layer-blowup"]["adds_detections"] >= 1
    assert adds["ml", "layer-healthy"]["adds_false_alarms"] == 0
