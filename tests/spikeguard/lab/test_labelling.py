"""The labelling rules, on made-up curves where the right answer is plain, and the labels files."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from spikeguard.lab.labelling import (
    LabelFileError,
    LabelledEvent,
    LabelRules,
    PointRule,
    label_events,
    label_folder,
    main,
    point_labels,
    point_rule_events,
    read_labels,
    write_labels,
)

FIXTURES = Path(__file__).parents[2] / "data" / "real_spikes"


def flat(n: int, seed: int = 0) -> list[float]:
    return list(3.0 + 0.02 * np.random.default_rng(seed).standard_normal(n))


def kinds(events):
    return [(e.start_step, e.end_step, e.kind) for e in events]


def test_one_point_at_one_and_a_half_times_the_median_is_an_outlier_step():
    losses = flat(100)
    losses[50] = 1.5 * float(np.median(losses[30:50])) + 0.01
    losses[70] = 1.45 * float(np.median(losses[50:70]))  # under the ratio: nothing
    assert kinds(label_events(range(100), losses)) == [(50, 50, "outlier_step")]


def test_nothing_is_labelled_before_twenty_clean_points():
    losses = flat(60)
    losses[10] = 10.0  # the initial fall of a loss looks like this: left alone
    assert label_events(range(60), losses) == []


def test_an_event_lasts_while_the_loss_stays_above_a_quarter_over_its_start_baseline():
    losses = flat(120)
    losses[40:52] = [6.0] + [4.2] * 10 + [3.8]  # 2x, then a 1.4x plateau, then 1.27x, then back
    events = label_events(range(120), losses)
    assert kinds(events) == [(40, 51, "spike")]
    assert events[0].points == 12 and events[0].peak_ratio == pytest.approx(2.0, abs=0.05)


def test_points_inside_an_event_do_not_teach_the_baseline():
    losses = flat(200)
    losses[40:100] = [6.0] * 60  # a 60-point plateau: with a rolling median it would end itself
    assert kinds(label_events(range(200), losses)) == [(40, 99, "spike")]


def test_an_event_that_runs_into_nan_is_a_divergence_and_the_nan_its_own_event():
    losses = flat(60) + [5.0, 9.0, 50.0, math.nan, math.inf, math.nan]
    assert kinds(label_events(range(66), losses)) == [
        (60, 62, "divergence"),
        (63, 65, "non_finite"),
    ]


def test_an_event_still_high_at_the_end_is_a_divergence_unless_the_curve_is_an_excerpt():
    losses = flat(40) + [5.0, 6.0, 7.0]
    assert kinds(label_events(range(43), losses)) == [(40, 42, "divergence")]
    assert kinds(label_events(range(43), losses, LabelRules(excerpt=True))) == [(40, 42, "spike")]


def test_a_sustained_rise_of_ten_percent_over_the_best_level_is_a_slow_rise():
    losses = flat(100) + list(
        3.0 + np.linspace(0, 0.6, 100) + 0.02 * np.random.default_rng(1).standard_normal(100)
    )
    events = label_events(range(200), losses)
    assert [e.kind for e in events] == ["slow_rise"]
    assert 100 < events[0].start_step < 190 and events[0].end_step == 199
    assert label_events(range(100), flat(100)) == []  # noise alone never rises 10 %


def test_labels_become_per_step_labels_on_the_original_steps():
    steps = [0, 100, 200, 300]
    labels = point_labels(steps, [LabelledEvent(100, 200, "spike", 2, 2.0)])
    assert [(lab.label, lab.kind) for lab in labels] == [
        (False, ""),
        (True, "spike"),
        (True, "spike"),
        (False, ""),
    ]
    with pytest.raises(LabelFileError, match="does not have"):
        point_labels(steps, [LabelledEvent(150, 200, "spike", 1, 2.0)])


def test_labels_files_round_trip_and_bad_ones_are_named(tmp_path):
    labels = {
        "a.csv": [LabelledEvent(5, 7, "spike", 3, 2.5), LabelledEvent(9, 9, "non_finite", 1, None)]
    }
    path = tmp_path / "labels.csv"
    write_labels(path, labels)
    assert read_labels(path) == labels
    path.write_text("file,start_step,end_step,kind\na.csv,5,7,wobble\n")
    with pytest.raises(LabelFileError, match=r"labels.csv:2: kind 'wobble'"):
        read_labels(path)
    path.write_text("file,start_step,kind\n")
    with pytest.raises(LabelFileError, match="lacks end_step"):
        read_labels(path)
    with pytest.raises(LabelFileError, match="cannot read"):
        read_labels(tmp_path / "missing.csv")


def test_the_fixture_labels_are_what_the_rules_give(tmp_path, capsys):
    """The stored labels are the rules' output: anyone can regenerate and check them."""
    assert label_folder(FIXTURES) == read_labels(FIXTURES / "labels.csv")
    assert main([str(FIXTURES)]) == 0
    assert capsys.readouterr().out == (FIXTURES / "labels.csv").read_text()


def test_the_fixture_labels_cover_every_kind_but_slow_rise():
    found = {e.kind for events in read_labels(FIXTURES / "labels.csv").values() for e in events}
    assert found == {"outlier_step", "spike", "divergence", "non_finite"}


def test_the_lab_labels_hold_the_fixture_rows():
    lab = read_labels(
        Path(__file__).parents[3] / "spikeguard" / "lab" / "labels" / "algoperf_submissions.csv"
    )
    for name, events in read_labels(FIXTURES / "labels.csv").items():
        assert lab[name] == events


@pytest.mark.heavy
def test_the_plot_shows_every_curve(tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the `plots` extra
    target = tmp_path / "labels.png"
    assert main([str(FIXTURES), "--plot", str(target), "--out", str(tmp_path / "labels.csv")]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "labels.csv").read_text() == (FIXTURES / "labels.csv").read_text()


def test_a_folder_that_is_not_there(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "not a folder" in capsys.readouterr().err


def test_the_point_rule_on_a_handcrafted_series():
    """1.3x the median of the previous 20 clean points, NaN/inf; labelled points stay out of it."""
    losses = [1.9, 2.1] * 10  # median 2.0 once 20 clean points are in
    losses += [2.6]  # 1.3 x 2.0 exactly: labelled (at or above)
    losses += [2.59]  # just under: clean
    losses += [9.0, 9.0, 9.0]  # a plateau: labelled throughout, never its own baseline
    losses += [math.nan, math.inf]  # non-finite: one event of its own kind
    losses += [2.1, 5.0]  # back, then a point over a baseline the plateau did not raise
    steps = [10 * i for i in range(len(losses))]
    events = point_rule_events(steps, losses)
    assert kinds(events) == [
        (200, 200, "spike"),
        (220, 240, "spike"),
        (250, 260, "non_finite"),
        (280, 280, "spike"),
    ]
    assert events[0].peak_ratio == pytest.approx(1.3) and events[1].points == 3
    assert point_rule_events(range(19), [1.0] * 18 + [100.0]) == []  # 18 clean points: too few
    assert kinds(point_rule_events(range(3), [1.0, math.nan, 1.0])) == [(1, 1, "non_finite")]


def test_the_point_rule_labels_file_is_what_the_rule_gives():
    """The shipped labels of the real spikes by the point rule are reproducible from the data."""
    folder = Path(__file__).parents[3] / "data" / "real-spikes" / "algoperf_submissions"
    shipped = Path(__file__).parents[3] / "spikeguard" / "lab" / "labels"
    assert read_labels(shipped / "algoperf_submissions.point-rule.csv") == {
        name: events for name, events in label_folder(folder, PointRule()).items() if events
    }
