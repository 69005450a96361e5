"""Real curves: loading the sets, clear errors when they are missing, and a real-data regression.

The fixture (tests/data/real_spikes, Apache-2.0, see SOURCES.md there) holds
four AlgoPerf runs with 8 labelled events: a 2-point and a 10-point spike, a
3-point spike, an outlier step, two spikes in a noisy DLRM run, its
divergence and its 36 NaN steps.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from spikeguard.cli import main
from spikeguard.cli.evaluate import system_marks
from spikeguard.lab.baselines import BASELINES, flag_run
from spikeguard.lab.evaluation import score_run, summarize
from spikeguard.lab import realdata
from spikeguard.lab.realdata import RealDataError, healthy_kinds, load_healthy_set, load_spike_set

FIXTURES = Path(__file__).parents[2] / "data" / "real_spikes"


@pytest.fixture(scope="module")
def runs():
    return load_spike_set(FIXTURES)


def test_each_logged_point_is_one_step_and_the_original_steps_are_kept(runs):
    assert [r.name for r in runs] == sorted(
        p.stem for p in FIXTURES.glob("*.csv") if p.name != "labels.csv"
    )
    wmt = next(r for r in runs if r.name == "wmt_jax__sfadamw_jax_v2__study0")
    assert [e.step for e in wmt.events[:3]] == [0, 1, 2] and wmt.steps[:3] == [0, 100, 200]
    labelled = [s for s, lab in zip(wmt.steps, wmt.labels) if lab.label]
    assert labelled == [86900, 87000, 87100] and {lab.kind for lab in wmt.labels if lab.label} == {
        "spike"
    }
    criteo = next(r for r in runs if r.name.startswith("v06_criteo"))
    assert sum(lab.kind == "non_finite" for lab in criteo.labels) == 36
    assert all(
        not math.isfinite(e.loss)
        for e, lab in zip(criteo.events, criteo.labels)
        if lab.kind == "non_finite"
    )


def test_missing_data_says_what_to_pass(tmp_path):
    with pytest.raises(RealDataError, match="not found at .*pass the folder"):
        load_spike_set(tmp_path / "nowhere")
    with pytest.raises(RealDataError, match="not found at .*pass the folder"):
        load_healthy_set(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RealDataError, match="no step,loss CSV"):
        load_healthy_set(empty)
    unlabelled = tmp_path / "unlabelled"
    unlabelled.mkdir()
    shutil.copy(FIXTURES / "wmt_jax__sfadamw_jax_v2__study0.csv", unlabelled)
    with pytest.raises(RealDataError, match="no labels for"):
        load_spike_set(unlabelled)
    with pytest.raises(RealDataError, match="lacks"):  # labels naming curves that are not there
        load_spike_set(unlabelled, FIXTURES / "labels.csv")


def test_a_healthy_folder_is_all_clean_runs(runs):
    healthy = load_healthy_set(FIXTURES)  # the labels file there is not taken for a curve
    assert len(healthy) == 4 and all(r.labels is None for r in healthy)


def test_evaluate_fails_clearly_without_the_data(tmp_path, capsys):
    assert main(["evaluate", "--real-spikes", str(tmp_path / "nowhere"), "--systems", "naive"]) == 2
    assert "real-spike data not found at" in capsys.readouterr().err


def score(name: str, runs) -> dict:
    scores = [
        score_run([e.step for e in r.events], r.labels, flag_run(BASELINES[name](), r.events))
        for r in runs
    ]
    return summarize(scores).as_dict()


# What each rule finds on the fixture's 8 events: a regression guard on real data.
# (recall, precision per alarm episode); measured 2026-11-30.
EXPECTED = {
    "naive": (0.75, 1.0),
    "six_sigma": (0.75, 6 / 11),  # its grad-norm rule fires on unlabelled grad-norm jumps
    "axolotl": (0.75, 1 / 6),
    "metaseq": (0.875, 1.0),
    "lightning": (0.5, 1.0),
    "llm_foundry": (0.0, None),  # five outliers in a row: never on these curves
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_trainer_rules_on_real_spikes(runs, name):
    summary = score(name, runs)
    assert summary["episodes"] == 8
    recall, precision = EXPECTED[name]
    assert summary["recall"] == pytest.approx(recall)
    assert summary["precision"] == (None if precision is None else pytest.approx(precision))


def test_evaluate_scores_real_spikes_and_healthy_runs_side_by_side(capsys):
    code = main(
        [
            "evaluate",
            "--real-spikes",
            str(FIXTURES),
            "--healthy",
            str(FIXTURES),
            "--systems",
            "six_sigma",
            "metaseq",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["systems"]["metaseq"]["rows"]
    assert rows["real-spikes"]["episodes"] == 8 and rows["healthy"]["episodes"] == 0
    assert (
        rows["healthy"]["false_alarms_per_10k"] > 0
    )  # the same curves, unlabelled: every alarm is false
    assert set(rows["real-spikes"]["by_kind"]) == {
        "outlier_step",
        "spike",
        "divergence",
        "non_finite",
    }
    assert report["inputs"]["real_spikes"] == str(FIXTURES)


def test_the_pipeline_on_real_spikes_does_not_regress(runs):
    """The whole pipeline (backtest) on the fixture (2026-12-01, the shared outlier model).

    7 of 8 events: the DLRM run's 2-point spike at point 34 (x2.6 then x1.8, in the
    run's chaotic first 40 points) is missed. No false incident; three one-step jumps
    of +21 % to +28 % that the labels leave out (their events start at x1.5) are
    outlier steps, each far outside its run's noise: the Guard skips those updates.
    """
    scores = [
        score_run([e.step for e in r.events], r.labels, system_marks("pipeline", r.events))
        for r in runs
    ]
    summary = summarize(scores)
    assert summary.detected >= 7 and summary.false_alarm_episodes <= 3
    assert all(
        summary.by_kind[k]["recall"] == 1.0 for k in ("outlier_step", "divergence", "non_finite")
    )
    assert summary.by_kind["non_finite"]["median_delay"] == 0
    assert summary.by_kind["spike"]["median_delay"] == 0  # the guard skips its first step at once
    # What it escalates: the outlier step is answered by the guard's skip, not as an incident.
    incidents = [
        score_run(
            [e.step for e in r.events],
            r.labels,
            [m for m in system_marks("pipeline", r.events) if m.type != "outlier_step"],
        )
        for r in runs
    ]
    escalated = summarize(incidents)
    assert escalated.by_kind["outlier_step"]["detected"] == 0
    assert escalated.by_kind["spike"]["detected"] >= 3 and escalated.precision == 1.0


@pytest.mark.xfail(
    strict=True,
    reason="metaseq's x2 over an EWM finds the DLRM spike at point 34 "
    "that the shared outlier model misses, with no outlier-step marks: a known gap",
)
def test_the_pipeline_beats_every_trainer_rule_on_the_fixture(runs):
    ours = summarize(
        [
            score_run([e.step for e in r.events], r.labels, system_marks("pipeline", r.events))
            for r in runs
        ]
    )
    for name in EXPECTED:
        theirs = score(name, runs)
        assert ours.recall > theirs["recall"] and ours.f1 > (theirs["f1"] or 0.0), name


def test_incidents_only_drops_the_skip_only_marks(capsys):
    args = ["evaluate", "--real-spikes", str(FIXTURES), "--systems", "pipeline", "--json"]
    assert main(args) == 0
    every = json.loads(capsys.readouterr().out)["systems"]["pipeline"]["rows"]["real-spikes"]
    assert main(args + ["--incidents-only"]) == 0
    report = json.loads(capsys.readouterr().out)
    escalated = report["systems"]["pipeline"]["rows"]["real-spikes"]
    assert report["inputs"]["incidents_only"] is True
    assert every["by_kind"]["outlier_step"]["detected"] == 1
    assert escalated["by_kind"]["outlier_step"]["detected"] == 0  # a healed jump is only skipped
    # a spike is escalated at its second elevated point, one step later; the DLRM run's
    # early spike at 22 has one elevated point only (its second is under the young x1.5 bar)
    assert escalated["by_kind"]["spike"]["detected"] >= every["by_kind"]["spike"]["detected"] - 1
    # (a spike x2.5 above the level is escalated at its first point)
    assert (
        escalated["by_kind"]["spike"]["median_delay"] <= 1
        and every["by_kind"]["spike"]["median_delay"] == 0
    )


def test_files_and_real_sets_are_not_mixed(capsys):
    assert main(["evaluate", "--files", "x.csv", "--healthy", str(FIXTURES)]) == 2
    assert "cannot be combined" in capsys.readouterr().err


REPOSITORY = Path(__file__).parents[3]


def test_from_a_clone_the_real_sets_default_to_the_repository_data():
    spikes = load_spike_set()  # data/real-spikes/algoperf_submissions, with the lab's labels
    assert len(spikes) == 11 and sum(len(r.truth) for r in spikes) > 0
    healthy = load_healthy_set()  # data/modded-nanogpt
    assert len(healthy) == 23 and all(r.labels is None for r in healthy)
    kinds = healthy_kinds()
    assert {"regression_b1", "char_lm", "modded-nanogpt", "mlperf-bert"} <= set(kinds)
    assert len(kinds["mlperf-bert"]) == 15


def test_every_data_source_carries_its_licence_and_sources():
    data = REPOSITORY / "data"
    for folder in (
        "real-spikes/algoperf_submissions",
        "real-spikes/bigscience_chronicles",
        "modded-nanogpt",
        "mlperf-bert",
        "held-out/modded-nanogpt",
        "held-out/mlperf-bert",
    ):
        assert (data / folder / "LICENSE").is_file() and (data / folder / "SOURCES.md").is_file(), (
            folder
        )
    assert (data / "healthy" / "SOURCES.md").is_file()  # made by the project: how, not a licence


def test_outside_a_clone_the_missing_data_folder_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(realdata, "REPO_DATA", tmp_path / "data")  # an installed wheel has no data/
    with pytest.raises(
        RealDataError, match="ship with the source repository.*pass the folder's path"
    ):
        load_spike_set()
    with pytest.raises(RealDataError, match="ship with the source repository"):
        healthy_kinds()
    assert main(["evaluate", "--healthy", "--systems", "naive"]) == 2
    assert "ship with the source repository" in capsys.readouterr().err


def test_the_held_out_runs_are_read_gzipped_and_are_not_the_development_runs():
    """data/held-out holds the rest of each public set, gzipped: no run in both halves."""
    from spikeguard.lab.labelling import curve_files
    from spikeguard.lab.runfile import plain_path, read_steps

    held_out: dict[str, list[Path]] = {}
    for name in ("mlperf-bert", "modded-nanogpt"):
        held_out[name] = curve_files(REPOSITORY / "data" / "held-out" / name)
        developed = {p.stem for p in curve_files(REPOSITORY / "data" / name)}
        assert held_out[name] and not {plain_path(p).stem for p in held_out[name]} & developed
    assert (len(held_out["mlperf-bert"]), len(held_out["modded-nanogpt"])) == (15, 52)
    events, labels = read_steps(held_out["mlperf-bert"][0])
    assert len(events) > 500 and labels is None and events[0].run_id == "dgx2h_n32_result_5"


def test_evaluate_reads_the_repository_data_when_given_no_folder(capsys):
    assert main(["evaluate", "--real-spikes", "--systems", "metaseq", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["systems"]["metaseq"]["rows"]
    assert rows["real-spikes"]["runs"] == 11 and rows["real-spikes"]["episodes"] > 0


def project_files() -> list[Path]:
    """The repository's files: those git tracks, else every file outside hidden folders."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPOSITORY, capture_output=True, check=True
        )
        return [REPOSITORY / name for name in listed.stdout.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        return [
            p
            for p in REPOSITORY.rglob("*")
            if p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(REPOSITORY).parts)
        ]


def test_nothing_in_the_project_points_outside_it():
    """A user's clone has only the repository: no path may lead to the sibling data folder."""
    sibling = ".." + "/shared"  # spelt apart, so that this file does not match itself
    offenders = []
    for path in project_files():
        if path.suffix == ".csv" or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        offenders += [
            f"{path.relative_to(REPOSITORY)}:{n}"
            for n, line in enumerate(text.splitlines(), 1)
            if sibling in line
        ]
    assert not offenders
