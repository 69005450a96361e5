"""``spikeguard simulate`` and ``spikeguard evaluate`` end to end (small runs)."""

from __future__ import annotations

import json

import pytest

from spikeguard.cli import main
from spikeguard.lab.baselines import NaiveBaseline
from spikeguard.lab.runfile import read_steps
from spikeguard.lab.simulate import SCENARIOS
from spikeguard.schemas import AnomalyType, Decision, decision_id


def test_simulate_writes_a_labelled_csv(tmp_path, capsys):
    out = tmp_path / "spike.csv"
    assert (
        main(["simulate", "sudden_spike", "--steps", "900", "--seed", "1", "--out", str(out)]) == 0
    )
    events, labels = read_steps(out)
    assert len(events) == 900 and labels is not None
    assert any(lab.label and lab.kind == "sudden_spike" for lab in labels)
    assert out.read_text().splitlines()[0].startswith("step,loss,grad_norm,lr,run_id,label,kind")
    assert "sudden_spike x" in capsys.readouterr().err
    again = tmp_path / "again.csv"
    main(["simulate", "sudden_spike", "--steps", "900", "--seed", "1", "--out", str(again)])
    assert again.read_text() == out.read_text()


def test_simulate_lists_scenarios_and_refuses_nonsense(capsys):
    assert main(["simulate", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in SCENARIOS)
    with pytest.raises(SystemExit):
        main(["simulate", "no_such_scenario"])
    with pytest.raises(SystemExit, match="at least"):
        main(["simulate", "stable", "--steps", "10"])


def test_evaluate_baselines_on_one_scenario_as_json(capsys):
    code = main(
        [
            "evaluate",
            "--systems",
            "naive",
            "six_sigma",
            "--scenario",
            "non_finite",
            "--seeds",
            "0",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    for name in ("naive", "six_sigma"):
        rows = report["systems"][name]["rows"]
        assert set(rows) == {"non_finite", "overall"}
        overall = rows["overall"]
        assert overall["episodes"] > 0 and 0 <= overall["recall"] <= 1
        assert overall["by_kind"]["non_finite"]["episodes"] > 0
    # the 6-sigma rule flags non-finite values at once; the naive one misses grad-only NaN/Inf
    assert (
        report["systems"]["six_sigma"]["rows"]["overall"]["by_kind"]["non_finite"]["recall"] == 1.0
    )
    assert "targets" not in report


def test_evaluate_files_and_the_text_table(tmp_path, capsys):
    labelled, plain = tmp_path / "a.csv", tmp_path / "b.csv"
    main(["simulate", "grad_explosion", "--steps", "1500", "--seed", "2", "--out", str(labelled)])
    plain.write_text("step,loss\n" + "".join(f"{i},{3.0 + 0.01 * (i % 3)}\n" for i in range(300)))
    capsys.readouterr()
    assert main(["evaluate", "--files", str(labelled), str(plain), "--systems", "naive"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("scenario"))
    assert "recall" in header and "precision" in header and "F1" in header and "FA/10k" in header
    assert "med delay" in header and "med lead" in header
    assert any(line.startswith("a ") for line in lines) and any(
        line.startswith("b ") for line in lines
    )
    assert any(line.startswith("clean runs") for line in lines)
    assert any(line.startswith("overall") for line in lines)


@pytest.mark.heavy
def test_evaluate_scores_the_pipeline_through_backtest_and_checks_targets(monkeypatch, capsys):
    """The pipeline's decisions flow through the same scoring; targets are reported."""
    import spikeguard.lab.backtest as backtest

    def fake_backtest(events, settings=None):  # stands in for the pipeline: the naive rule
        baseline = NaiveBaseline()
        return [
            Decision(
                decision_id=decision_id(e.run_id, e.step),
                run_id=e.run_id,
                step=e.step,
                is_anomaly=(flag := baseline.update(e)),
                type=AnomalyType.LOSS_SPIKE if flag else AnomalyType.NONE,
            )
            for e in events
        ]

    monkeypatch.setattr(backtest, "backtest_events", fake_backtest)
    code = main(
        [
            "evaluate",
            "--scenario",
            "sudden_spike",
            "stable",
            "--seeds",
            "1",
            "--json",
            "--check",
            "--systems",
            "pipeline",
            "naive",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    pipeline, naive = (report["systems"][k]["rows"] for k in ("pipeline", "naive"))
    assert pipeline["overall"] == naive["overall"]  # same decisions, same scores
    targets = {t["target"]: t for t in report["targets"]}
    f1_check = targets["F1 above naive on every scenario and overall"]
    assert f1_check["ok"] is False and "overall" in f1_check["value"]
    assert code == 1  # --check: a missed target fails the command


def test_evaluate_scores_each_run_of_a_multi_run_file_alone(tmp_path, capsys):
    rows = ["step,loss,run_id,label,kind"]
    for run in ("a", "b"):
        rows += [f"{i},{2.0 + 0.01 * (i % 2)},{run},0," for i in range(200)]
        rows.append(f"200,nan,{run},1,non_finite")
    path = tmp_path / "two.csv"
    path.write_text("\n".join(rows) + "\n")
    assert main(["evaluate", "--files", str(path), "--systems", "naive", "--json"]) == 0
    overall = json.loads(capsys.readouterr().out)["systems"]["naive"]["rows"]["overall"]
    assert overall["runs"] == 2 and overall["episodes"] == 2 and overall["recall"] == 1.0
    assert overall["false_alarms_per_10k"] == 0.0


def test_loss_only_strips_the_other_signals_and_their_labels():
    from spikeguard.cli.evaluate import loss_only
    from spikeguard.lab.simulate import generate

    run = generate("non_finite", 1500, seed=4)
    events, labels = loss_only(run.events, run.labels)
    assert all(e.grad_norm is None and e.lr is None and e.update_norm is None for e in events)
    assert [e.loss for e in events][:50] == [e.loss for e in run.events][:50]
    grad_only = [
        i
        for i, (e, lab) in enumerate(zip(run.events, run.labels))
        if lab.kind == "non_finite" and e.loss == e.loss and abs(e.loss) != float("inf")
    ]
    assert grad_only, "seed 4 has a non-finite gradient norm with a finite loss"
    assert all(not labels[i].label for i in grad_only)
    assert any(lab.label for lab in labels)


EVALUATE_TWO_RUNS = [
    "-m",
    "spikeguard",
    "evaluate",
    "--seeds",
    "0",
    "--scenario",
    "stable",
    "sudden_spike",
    "--systems",
    "naive",
    "--json",
]


def test_evaluate_shows_progress_on_a_terminal_only(terminal_stderr):
    import sys

    command = [sys.executable, *EVALUATE_TWO_RUNS]
    on_terminal = terminal_stderr(command, on_a_terminal=True)
    assert "\revaluate:" in on_terminal and "run/s" in on_terminal  # tqdm's bar over the runs
    off_terminal = terminal_stderr(command, on_a_terminal=False)
    assert "\r" not in off_terminal and "run/s" not in off_terminal
    assert off_terminal.count("\n") == 1 and off_terminal.startswith(
        "evaluate: "
    )  # the summary alone
