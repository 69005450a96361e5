"""spikeguard beside the six-sigma and robust-z rules: the same runs, the same labels."""

from __future__ import annotations

import gzip

import numpy as np

from spikeguard.cli import main
from spikeguard.lab import realdata
from spikeguard.lab.labelling import PointRule, label_folder, write_labels
from spikeguard.lab.runfile import StepLabel
from spikeguard.lab.side_by_side import ROBUST_Z, SIX_SIGMA, SPIKEGUARD, ScoredRun, compare, render
from spikeguard.schemas import StepEvent

SPIKE_AT = 400


def flat_losses(n: int, seed: int) -> list[float]:
    return [float(x) for x in 3.0 * np.exp(0.01 * np.random.default_rng(seed).standard_normal(n))]


def events_of(losses: list[float], run_id: str) -> list[StepEvent]:
    return [
        StepEvent(run_id=run_id, step=i, time=float(i), loss=loss) for i, loss in enumerate(losses)
    ]


def test_every_system_is_scored_on_the_same_runs_and_labels():
    spiked = flat_losses(600, 1)
    spiked[SPIKE_AT] *= 20
    labels = [StepLabel(i == SPIKE_AT, "spike" if i == SPIKE_AT else "") for i in range(600)]
    runs = [
        ScoredRun("set", events_of(spiked, "spiked"), labels, "none"),
        ScoredRun("set", events_of(flat_losses(600, 2), "calm"), None, "none"),
    ]
    report = compare(runs)
    figures = report["sets"]["set"]
    assert set(figures) == {SPIKEGUARD, SIX_SIGMA, ROBUST_Z} and report["steps"] == 1200
    for name, f in figures.items():
        assert f["summary"]["runs"] == 2 and f["summary"]["episodes"] == 1, name
        assert f["summary"]["recall"] == 1.0, name  # a x20 point on 1 % noise: nobody misses it
        assert f["healthy_steps"] == 600, name  # only the calm run counts for false actions
    assert set(figures[SPIKEGUARD]["false_actions"]) == {
        "stops",
        "rollbacks",
        "lr_cuts",
        "skipped_batches",
        "local_skips",
        "high_urgency_episodes",
    }
    listed = figures[SIX_SIGMA]["runs"]  # every run, to find the ones behind a figure
    assert [(r["run"], r["episodes"], r["found"]) for r in listed] == [
        ("spiked", 1, 1),
        ("calm", 0, 0),
    ]
    text = render(report, "made-up runs")
    for name in (SPIKEGUARD, SIX_SIGMA, ROBUST_Z):
        assert text.count(f" {name} ") == 2, name


def write_curve(path, losses) -> None:
    text = "step,loss\n" + "".join(f"{i},{loss!r}\n" for i, loss in enumerate(losses))
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as handle:
            handle.write(text)
    else:
        path.write_text(text)


def test_evaluate_held_out_reads_the_point_rule_labels_and_the_held_out_folders(
    tmp_path, monkeypatch, capsys
):
    data, labels = tmp_path / "data", tmp_path / "labels"
    spikes = data / "real-spikes" / "algoperf_submissions"
    for folder in (spikes, data / "held-out" / "mlperf-bert", data / "held-out" / "modded-nanogpt"):
        folder.mkdir(parents=True)
    spiked = flat_losses(300, 3)
    spiked[200] *= 3
    write_curve(spikes / "lm.csv", spiked)
    write_curve(data / "held-out" / "mlperf-bert" / "bert.csv.gz", flat_losses(300, 4))
    write_curve(data / "held-out" / "modded-nanogpt" / "gpt.csv", flat_losses(300, 5))
    labels.mkdir()
    write_labels(labels / "algoperf_submissions.point-rule.csv", label_folder(spikes, PointRule()))
    monkeypatch.setattr(realdata, "REPO_DATA", data)
    monkeypatch.setattr(realdata, "LABELS_DIR", labels)
    assert main(["evaluate", "--held-out"]) == 0
    out = capsys.readouterr().out
    for name in ("real spikes (1.3x rule)", "held-out/mlperf-bert", "held-out/modded-nanogpt"):
        expected = 6 if name.startswith("held") else 3  # healthy sets: in both tables
        assert out.count(name) == expected, name
    assert "spike 1/1" in out
