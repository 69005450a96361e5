"""The three forensics features in the demo, and `spikeguard report` / `inspect` showing them."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from spikeguard.cli import main


def _demo(fault, tmp_path):
    from spikeguard.demo.run import DEMO_SETTINGS, run_demo
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    runtime = open_runtime(
        load_settings({**DEMO_SETTINGS, "data_dir": str(tmp_path / "bus")}, env={})
    )
    try:
        return run_demo(fault, seed=0, runtime=runtime, keep_incidents=str(tmp_path / "incidents"))
    finally:
        runtime.close()


def test_the_poison_demo_names_its_planted_samples_and_the_layer(tmp_path, capsys):
    outcome = _demo("poison", tmp_path)
    assert len(outcome.planted) == 3 and outcome.incident_files
    assert (
        main(
            [
                "inspect",
                outcome.incident_files[0],
                "--setup",
                "spikeguard.demo.model:inspect_setup",
                "--json",
            ]
        )
        == 0
    )  # written beside the record, where the report looks
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(outcome.planted) <= {row["sample_id"] for row in report["top"][:5]}
    assert set(outcome.planted) <= set(report["skip_ids"])

    from spikeguard.reporting import build_timeline, load_directory

    timeline = build_timeline(next(iter(load_directory(tmp_path / "bus").values())))
    onset = next(i for i in timeline.incidents if i.onset_step >= 100)
    # inspect's onset is the report's: the record is kept around the onset fusion found
    assert (report["incident_id"], report["onset_step"]) == (onset.incident_id, onset.onset_step)
    # The planted inputs are x10^4 one-hot rows: the first layer's gradient is the one that blows up.
    assert onset.layers and onset.layers[0]["layer"] == "net.0.weight"

    assert (
        main(
            [
                "report",
                "--data-dir",
                str(tmp_path / "bus"),
                "--out",
                str(tmp_path / "report"),
                "--incidents",
                str(tmp_path / "incidents"),
            ]
        )
        == 0
    )
    page = next((tmp_path / "report").glob("*.html")).read_text()
    assert "net.0.weight: share" in page
    # The Guard skipped the poisoned update and the loss came straight back: the incident is
    # absorbed, with no rollback and no skip window; its record still names the samples.
    assert outcome.rollbacks == 0 and outcome.skipped_batches == 0
    assert (
        "top offenders (spikeguard inspect): "
        + ", ".join(f"{row['sample_id']} (score {row['score']})" for row in report["top"][:5])
        in page
    )


def test_the_flaky_demo_re_runs_its_faulty_steps_as_transient_and_the_report_says_so(
    tmp_path, capsys
):
    outcome = _demo("flaky", tmp_path)
    assert outcome.transient_steps == 3 and outcome.rollbacks == 0
    assert (
        main(["report", "--data-dir", str(tmp_path / "bus"), "--out", str(tmp_path / "report")])
        == 0
    )
    page = next((tmp_path / "report").glob("*.html")).read_text()
    assert "Re-run steps" in page and "Transient</b> (the re-run differed" in page
    assert "100 (epoch 0), 101 (epoch 0), 102 (epoch 0)" in page
