"""The backtest contract, replay and report, through the real CLI."""

import json
import math
import subprocess
import sys

import pytest

from spikeguard.cli import build_parser, main
from spikeguard.lab.backtest import backtest_events
from spikeguard.runtime import open_runtime
from spikeguard.schemas import StepEvent, encode
from spikeguard.settings import load_settings
from spikeguard.schemas.signing import sign_step


def healthy_loss(step: int) -> float:
    # A decaying loss with a small deterministic wiggle.
    return 3.0 * (step + 10) ** -0.3 * (1 + 0.01 * math.sin(step * 1.7))


def write_csv(path, steps=600, nan_at=400, spike_at=250):
    lines = ["step,loss"]
    for step in range(steps):
        loss = healthy_loss(step)
        if step == nan_at:
            lines.append(f"{step},nan")
            continue
        if spike_at <= step < spike_at + 6:
            loss *= 8
        lines.append(f"{step},{loss!r}")
    path.write_text("\n".join(lines) + "\n")


def test_backtest_writes_a_decision_line_for_every_anomaly_deterministically(tmp_path, capsys):
    source = tmp_path / "run.csv"
    write_csv(source)
    outputs = []
    for name in ("a.jsonl", "b.jsonl"):
        assert main(["backtest", str(source), "--out", str(tmp_path / name)]) == 0
        outputs.append((tmp_path / name).read_text())
    assert outputs[0] == outputs[1]
    lines = [json.loads(line) for line in outputs[0].splitlines()]
    for line in lines:
        assert {"run_id", "step", "is_anomaly", "type", "confidence", "urgency"} <= set(line)
    anomalous = {line["step"]: line for line in lines if line["is_anomaly"]}
    assert anomalous[400]["type"] == "non_finite" and anomalous[400]["urgency"] == "critical"
    assert 250 in anomalous
    assert "steps/s" in capsys.readouterr().err


def test_backtest_reads_jsonl_step_events(tmp_path):
    source = tmp_path / "run.jsonl"
    events = [StepEvent(run_id="j", step=s, loss=healthy_loss(s)) for s in range(300)]
    events[200] = StepEvent(run_id="j", step=200, loss=math.inf)
    source.write_bytes(b"\n".join(encode(e) for e in events) + b"\n")
    out = tmp_path / "out.jsonl"
    assert main(["backtest", str(source), "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert any(l["step"] == 200 and l["type"] == "non_finite" and l["run_id"] == "j" for l in lines)


def test_backtest_names_the_bad_line_of_a_broken_file(tmp_path, capsys):
    source = tmp_path / "bad.csv"
    source.write_text("step,loss\n0,1.0\n1,abc\n")
    assert main(["backtest", str(source), "--out", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "bad.csv" in err and "3" in err  # the file and the line


def test_replay_rejudges_a_recorded_embedded_run_and_report_summarises_it(tmp_path, capsys):
    record = tmp_path / "recorded"
    settings = load_settings({"data_dir": str(record)}, env={})
    events = [StepEvent(run_id="rec", step=s, loss=healthy_loss(s)) for s in range(400)]
    events[300] = StepEvent(run_id="rec", step=300, loss=math.nan)
    with open_runtime(settings) as runtime:
        producer = runtime.bus.producer()
        for event in events:  # signed, as the trainer signs them with the runtime's own key
            event = sign_step(event, runtime.settings.signing_key)
            producer.publish(runtime.topics.steps, encode(event), key="rec")
        producer.flush()
        import time

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(runtime.bus.read_all(runtime.topics.decisions)) >= 400:
                break
            time.sleep(0.1)
    capsys.readouterr()
    assert main(["replay", "--data-dir", str(record), "--out", str(tmp_path / "re.jsonl")]) == 0
    said = capsys.readouterr().out
    assert "replayed 400 steps of 1 run(s)" in said
    assert "new 0, gone 0, type changed 0" in said  # same settings, same judgement
    rejudged = [json.loads(l) for l in (tmp_path / "re.jsonl").read_text().splitlines()]
    assert any(l["step"] == 300 and l["type"] == "non_finite" for l in rejudged)
    expected = [d for d in backtest_events(events) if d.is_anomaly]
    assert [(l["step"], l["type"]) for l in rejudged if l["is_anomaly"]] == [
        (d.step, d.type.value) for d in expected
    ]

    assert main(["report", "--data-dir", str(record), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    incidents = report["runs"]["rec"]["incidents"]
    assert any(i["onset_step"] == 300 and i["type"] == "non_finite" for i in incidents)


def command_names():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return sorted(action.choices)


def test_every_command_has_help(capsys):
    names = command_names()
    assert {
        "backtest",
        "simulate",
        "evaluate",
        "demo",
        "worker",
        "replay",
        "report",
        "presets",
        "schemas",
    } <= set(names)
    for name in names:
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([name, "--help"])
        assert done.value.code == 0
        assert f"usage: spikeguard {name}" in capsys.readouterr().out, name


def test_the_console_entry_point_runs():
    done = subprocess.run(
        [sys.executable, "-m", "spikeguard", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "backtest" in done.stdout


def test_backtest_into_a_missing_directory_is_a_one_line_error(tmp_path, capsys):
    source = tmp_path / "run.csv"
    write_csv(source, steps=50)
    assert main(["backtest", str(source), "--out", str(tmp_path / "nowhere" / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "nowhere" in err
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("spelling", ["same", "dotted", "link"])
def test_backtest_refuses_to_write_over_its_input(tmp_path, capsys, monkeypatch, spelling):
    source = tmp_path / "run.csv"
    write_csv(source, steps=50)
    before = source.read_text()
    monkeypatch.chdir(tmp_path)
    out = {"same": str(source), "dotted": "./sub/../run.csv", "link": str(tmp_path / "alias.csv")}
    (tmp_path / "sub").mkdir()
    (tmp_path / "alias.csv").symlink_to(source)
    assert main(["backtest", str(source), "--out", out[spelling]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is the input file" in err
    assert source.read_text() == before


def test_a_file_broken_half_way_leaves_no_output(tmp_path, capsys):
    source = tmp_path / "run.csv"
    write_csv(source, steps=3000)
    source.write_text(source.read_text() + "3000,abc\n")
    out = tmp_path / "o.jsonl"
    assert main(["backtest", str(source), "--out", str(out)]) == 2
    assert "run.csv:3002" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "o.jsonl.part").exists()


def _backtest_stderr(tmp_path, terminal_stderr, on_a_terminal: bool) -> str:
    source = tmp_path / "run.csv"
    write_csv(source, steps=3000)
    command = [
        sys.executable,
        "-m",
        "spikeguard",
        "backtest",
        str(source),
        "--out",
        str(tmp_path / "o.jsonl"),
    ]
    return terminal_stderr(command, on_a_terminal)


def test_backtest_shows_progress_on_a_terminal(tmp_path, terminal_stderr):
    err = _backtest_stderr(tmp_path, terminal_stderr, on_a_terminal=True)
    assert "\rbacktest:   0%|" in err and "B/s]" in err  # tqdm's bar over the file's bytes
    assert "3000 steps" in err  # the summary still follows


def test_backtest_is_silent_but_for_its_summary_off_a_terminal(tmp_path, terminal_stderr):
    err = _backtest_stderr(tmp_path, terminal_stderr, on_a_terminal=False)
    assert err.count("\n") == 1 and err.startswith("backtest: 3000 steps")
    assert "%" not in err and "\r" not in err


def test_backtest_reports_the_local_skips_the_live_guard_would_take(tmp_path, capsys):
    """The Guard skips an isolated outlier's update itself, before the pipeline hears of it:
    the backtest says so, with the Guard's own rule (which stands aside after two in a row)."""
    source = tmp_path / "run.csv"
    write_csv(source)  # x8 for six steps from 250, NaN at 400 (non-finite: the Guard's other rule)
    assert main(["backtest", str(source), "--out", str(tmp_path / "out.jsonl")]) == 0
    assert "; 2 local skips by the Guard's skip rule (steps 250, 251)" in capsys.readouterr().err


def test_backtest_reports_the_skips_a_recorded_live_run_made(tmp_path, capsys):
    source = tmp_path / "run.jsonl"
    events = [StepEvent(run_id="j", step=s, loss=healthy_loss(s)) for s in range(300)]
    events[120] = events[120].model_copy(
        update={"loss": 5 * events[120].loss, "skip_reason": "outlier_step"}
    )
    events[200] = StepEvent(run_id="j", step=200, loss=math.inf, skip_reason="non_finite")
    source.write_bytes(b"\n".join(encode(e) for e in events) + b"\n")
    assert main(["backtest", str(source), "--out", str(tmp_path / "out.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "1 local skips by the Guard's skip rule (steps 120)" in err
    assert "recorded in the file: 1 non_finite, 1 outlier_step" in err
