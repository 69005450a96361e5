"""``spikeguard report`` on a recorded run: PNG and HTML, from a directory or a JSONL export."""

from __future__ import annotations

import json
import math
import struct

import pytest

from spikeguard.cli import main
from spikeguard.reporting import ReportError, RunRecord, build_timeline, load_directory, load_jsonl
from spikeguard.reporting.figure import figure
from spikeguard.schemas import Ack, AckStatus, Action, ActionKind, Decision, StepEvent, Urgency


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A guarded demo run through a NaN fault, recorded by the embedded bus."""
    from spikeguard.demo.model import DemoSetup
    from spikeguard.demo.run import DEMO_SETTINGS, run_demo
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    directory = tmp_path_factory.mktemp("recorded")
    runtime = open_runtime(load_settings({**DEMO_SETTINGS, "data_dir": str(directory)}, env={}))
    try:
        outcome = run_demo("nan", seed=0, setup=DemoSetup(steps=150), runtime=runtime)
    finally:
        runtime.close()
    assert outcome.rollbacks == 1
    return directory


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return struct.unpack(">II", data[16:24])


def test_report_writes_png_and_html_for_a_recorded_directory(recorded, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["report", "--data-dir", str(recorded), "--out", str(out), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    (run_id,) = said["runs"]
    assert any(
        i["type"] == "non_finite" and i["urgency"] == "critical"
        for i in said["runs"][run_id]["incidents"]
    )
    png, page = out / f"{run_id}.png", out / f"{run_id}.html"
    assert said["files"] == [str(png), str(page)]
    assert _png_size(png) == (1200, 800)
    html = page.read_text()
    assert "data:image/png;base64," in html
    assert "UTC</td>" in html  # incidents and acks with wall-clock times
    assert "non_finite" in html and "critical" in html
    assert "rules: <b>anomaly</b>" in html  # which detectors said what
    assert "vs 2." in html  # the loss against its baseline
    for kind in ("rollback", "skip_batches", "scale_lr"):
        assert f"<td>{kind}</td>" in html
    assert "rolled back to step" in html and "applied" in html
    assert "re-run in epoch 1" in html


def test_the_timeline_marks_reruns_anomalies_and_the_rollback(recorded):
    (record,) = load_directory(recorded).values()
    timeline = build_timeline(record)
    assert timeline.epochs == [0, 1]
    ((start, target, epoch),) = timeline.rollbacks
    assert epoch == 1 and target < start
    reruns = [p for p in timeline.steps if p.rerun]
    assert reruns and all(p.epoch == 1 and target <= p.step <= start for p in reruns)
    assert any(not math.isfinite(p.loss) for p in timeline.steps if p.epoch == 0)
    assert any(t == "non_finite" for _, _, t in timeline.anomalies)
    (incident,) = timeline.incidents
    assert incident.time is not None and incident.baseline is not None
    assert incident.detectors["rules"]["anomaly"] is True


def test_the_figure_has_axes_labels_and_a_legend(recorded):
    (record,) = load_directory(recorded).values()
    timeline = build_timeline(record)
    fig = figure(timeline, title="t")
    loss_axes, grad_axes, lr_axes, skip_axes = fig.axes
    assert loss_axes.get_ylabel() == "training loss"
    assert lr_axes.get_xlabel() == "optimizer step"
    assert grad_axes.get_yscale() == "log"
    # what the policy changed: the LR each update used (halved by the recovery), the data skipped
    (lr_line, *_) = [line for line in lr_axes.get_lines() if line.get_label() == "LR used"]
    used = [y for y in lr_line.get_ydata() if y == y]
    assert min(used) < 0.75 * max(used)
    (skipped,) = skip_axes.get_lines()
    assert skipped.get_ydata()[-1] == sum(n for _, _, n in timeline.data_skips) > 0
    legend = [t.get_text() for t in loss_axes.get_legend().get_texts()]
    for entry in (
        "loss",
        "loss, re-run after rollback",
        "anomalous step",
        "incident",
        "action applied",
        "rollback (arrow: to its checkpoint)",
        "non-finite loss (drawn at the top)",
    ):
        assert entry in legend
    texts = [t.get_text() for t in loss_axes.texts]
    assert any(t.startswith("rollback -> step") for t in texts)
    assert loss_axes.get_xticklabels() or lr_axes.get_xticklabels()


def test_a_jsonl_export_reports_the_same(recorded, tmp_path, capsys):
    export = tmp_path / "run.jsonl"
    assert main(["report", "--data-dir", str(recorded), "--export", str(export), "--json"]) == 0
    from_dir = json.loads(capsys.readouterr().out)
    assert main(["report", "--jsonl", str(export), "--json"]) == 0
    from_jsonl = json.loads(capsys.readouterr().out)
    assert from_jsonl["runs"] == from_dir["runs"]
    (a,) = load_directory(recorded).values()
    (b,) = load_jsonl(export).values()
    ta, tb = build_timeline(a), build_timeline(b)
    assert ta.rollbacks == tb.rollbacks and len(ta.steps) == len(tb.steps)


def test_a_wrong_source_is_an_error_not_an_empty_report(tmp_path, capsys):
    assert main(["report", "--data-dir", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()  # and it was not created
    (tmp_path / "empty").mkdir()
    assert main(["report", "--data-dir", str(tmp_path / "empty")]) == 2
    assert "not a recording" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"topic": "steps", "event": {"run_id": "x"}}\n')
    assert main(["report", "--jsonl", str(bad)]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    ok = tmp_path / "ok.jsonl"
    ok.write_text(
        '{"topic": "steps", "event": '
        + StepEvent(run_id="a", step=0, loss=1.0).model_dump_json()
        + "}\n"
    )
    assert list(load_jsonl(ok)) == ["a"]
    with pytest.raises(ReportError, match="no step events of run"):
        load_jsonl(ok, runs={"b"})  # a mistyped --run-id is an error too


def test_actions_without_an_ack_and_a_rollback_from_events():
    steps = [
        StepEvent(run_id="r", step=s, loss=1.0, grad_norm=0.5, time=100.0 + s) for s in range(30)
    ]
    steps[20] = StepEvent(run_id="r", step=20, loss=math.inf, time=120.0)
    steps += [
        StepEvent(run_id="r", step=s, epoch=1, loss=0.9, time=200.0 + s) for s in range(11, 30)
    ]
    decision = Decision(
        decision_id="d",
        run_id="r",
        step=20,
        is_anomaly=True,
        urgency=Urgency.CRITICAL,
        incident_id="i",
        incident_onset_step=20,
    )
    actions = [
        Action(
            action_id="a1",
            run_id="r",
            kind=ActionKind.ROLLBACK,
            apply_at_step=21,
            params={"target_step": 10},
        ),
        Action(action_id="a2", run_id="r", kind=ActionKind.STOP, apply_at_step=21),
    ]
    acks = [
        Ack(
            run_id="r",
            action_id="a1",
            kind=ActionKind.ROLLBACK,
            status=AckStatus.APPLIED,
            step=21,
            time=150.0,
        )
    ]
    timeline = build_timeline(
        RunRecord("r", steps=steps, decisions=[decision], actions=actions, acks=acks)
    )
    assert timeline.rollbacks == [(21, 10, 1)]
    assert [a.ack_status for a in timeline.actions] == ["applied", "no ack"]
    assert timeline.incidents[0].time == 120.0 and timeline.incidents[0].baseline == 1.0
    assert sum(p.rerun for p in timeline.steps) == 19


def test_a_loss_beyond_the_axis_is_marked_with_its_value():
    steps = [
        StepEvent(run_id="r", step=s, loss=2.0 + 0.01 * (s % 5), grad_norm=1.0, time=float(s))
        for s in range(100)
    ]
    steps[60] = StepEvent(run_id="r", step=60, loss=4000.0, grad_norm=900.0, time=60.0)
    fig = figure(build_timeline(RunRecord("r", steps=steps)))
    loss_axes = fig.axes[0]
    assert loss_axes.get_ylim()[1] < 10  # one spike does not flatten the curve
    assert "4e+03" in [t.get_text() for t in loss_axes.texts]
    assert "loss above the axis (value noted)" in [
        t.get_text() for t in loss_axes.get_legend().get_texts()
    ]


def test_action_labels_sit_where_the_actions_happened_and_do_not_overlap(recorded):
    """The rollback's plan (skip, LR cut, clip: applied at the rewound step, epoch 1) is labelled
    at the step the rollback happened, once; the LR restores a few steps later get their own
    labels, none drawn over another."""
    from itertools import combinations

    from spikeguard.reporting.figure import ACTION

    (record,) = load_directory(recorded).values()
    timeline = build_timeline(record)
    fig = figure(timeline)
    loss_axes = fig.axes[0]
    labels = [t for t in loss_axes.texts if t.get_color() == ACTION]
    ((start, _, _),) = timeline.rollbacks
    (plan,) = [t for t in labels if "skip_batches" in t.get_text()]
    assert plan.xy[0] == start and "rollback" in plan.get_text()
    assert [step for step, _, _ in timeline.data_skips] == [start]  # the skip too, not at 80
    assert sum("restore_lr" in t.get_text() for t in labels) == 2
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in labels]
    for (a, ta), (b, tb) in combinations(zip(boxes, labels), 2):
        assert not a.overlaps(b), f"{ta.get_text()!r} over {tb.get_text()!r}"


def test_the_page_and_the_json_give_each_runs_goodput(recorded, tmp_path, capsys):
    """Steps kept, re-run, batches skipped, updates skipped and the wall time spent re-running,
    counted from the recorded steps and acks as the Prometheus series count them."""
    (record,) = load_directory(recorded).values()
    timeline = build_timeline(record)
    g = timeline.goodput
    assert g.steps_kept == 150  # DemoSetup(steps=150): the run reached its end
    assert g.steps_rerun == sum(p.rerun for p in timeline.steps) > 0
    assert g.batches_skipped == sum(n for _, _, n in timeline.data_skips) > 0
    assert g.updates_skipped == sum(e.update_skipped for e in record.steps if e.rank == 0) >= 1
    assert g.recovery_seconds > 0
    assert 0 < g.ratio < 1
    out = tmp_path / "report"
    assert main(["report", "--data-dir", str(recorded), "--out", str(out), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    (run_id,) = said["runs"]
    assert said["runs"][run_id]["goodput"] == g._asdict()
    page = (out / f"{run_id}.html").read_text()
    assert "<h2>Goodput</h2>" in page
    for cell in (
        f"<td>{g.steps_kept}</td>",
        f"<td>{g.steps_rerun}</td>",
        f"<td>{g.batches_skipped}</td>",
        f"<td>{g.updates_skipped}</td>",
    ):
        assert cell in page
    assert main(["report", "--data-dir", str(recorded)]) == 0
    assert f"goodput {g.ratio:.1%}: {g.steps_kept} steps kept" in capsys.readouterr().out


def test_the_page_gives_a_ratio_only_for_a_positive_loss():
    from spikeguard.reporting.page import _versus

    assert _versus(6.0, 2.0) == " (3.0x)"
    assert _versus(0.4, -0.9) == " (+1.3)"  # a Gaussian NLL: "-0.4x" would say nothing
    assert _versus(None, 2.0) == _versus(float("nan"), 2.0) == _versus(1.0, None) == ""


def _rolled_back_run() -> RunRecord:
    """Steps 0..104 in epoch 0, a rollback to 90, steps 91..199 in epoch 1; every checkpoint
    announced when saved, some again when demoted (healthy=False) and when rotated out."""
    from spikeguard.schemas import CheckpointEvent

    steps = [StepEvent(run_id="r", step=s, loss=2.0, grad_norm=1.0) for s in range(105)]
    steps += [
        StepEvent(run_id="r", step=s, epoch=1, loss=2.0, grad_norm=1.0) for s in range(91, 200)
    ]
    saved = [(s, 0) for s in range(10, 105, 10)] + [(s, 1) for s in range(100, 200, 10)]
    checkpoints = [
        CheckpointEvent(run_id="r", step=s, epoch=e, checkpoint_id=f"c{s}-{e}", healthy=True)
        for s, e in saved
    ]
    checkpoints += [c.model_copy(update={"healthy": False}) for c in checkpoints[9:10]]
    checkpoints += [c.model_copy(update={"deleted": True}) for c in checkpoints[:12]]
    return RunRecord("r", steps=steps, checkpoints=checkpoints)


def test_the_checkpoint_count_is_the_guard_s(tmp_path):
    # Issue 38: the report said 82 checkpoints where the Guard's counters said 43 (each one is
    # announced again when demoted and when rotated out).
    assert build_timeline(_rolled_back_run()).checkpoints == 20


def test_only_the_steps_trained_before_are_drawn_as_re_run():
    # Issue 38: steps 900-2,000 drawn as "re-run after rollback" where 108 were re-run: the
    # epoch's line took the colour of its first step.
    from spikeguard.reporting.figure import RERUN

    timeline = build_timeline(_rolled_back_run())
    assert sum(p.rerun for p in timeline.steps) == 14  # steps 91..104 of epoch 1
    fig = figure(timeline)
    rerun_steps = set()
    for line in fig.axes[0].get_lines():
        if line.get_color() == RERUN:
            rerun_steps.update(int(x) for x in line.get_xdata())
    assert rerun_steps and rerun_steps <= set(range(90, 106)), sorted(rerun_steps)
