"""``spikeguard demo``: the command line, the JSON outcome and the PNG."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np

from spikeguard.cli import main
from spikeguard.demo.plot import loss_plot, write_png


def test_demo_json_and_plot(tmp_path, capsys):
    png = tmp_path / "curve.png"
    assert main(["demo", "--fault", "nan", "--steps", "150", "--json", "--plot", str(png)]) == 0
    outcome = json.loads(capsys.readouterr().out)
    for key in ("final_eval_loss", "steps", "incidents", "rollbacks", "skipped_batches", "actions_applied"):
        assert key in outcome
    assert outcome["steps"] == 150 and outcome["nonfinite_updates"] == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (900, 420)


def test_png_writer_round_trips_pixels(tmp_path):
    image = np.zeros((3, 4, 3), dtype=np.uint8)
    image[1, 2] = (255, 127, 14)
    path = tmp_path / "p.png"
    write_png(str(path), image)
    data = path.read_bytes()
    idat = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat - 4:idat])[0]
    raw = zlib.decompress(data[idat + 4: idat + 4 + length])
    rows = [raw[r * 13 + 1:(r + 1) * 13] for r in range(3)]
    assert rows[1][6:9] == bytes((255, 127, 14)) and raw[0] == 0


def test_plot_handles_nan_and_rollbacks(tmp_path):
    losses = [(s, 0, 3.0 - s * 0.01) for s in range(50)] + [(50, 0, float("nan"))]
    losses += [(s, 1, 2.6 - s * 0.01) for s in range(40, 80)]
    loss_plot(str(tmp_path / "x.png"), losses, anomalies=[50], actions=[51, 40], rollbacks=[(51, 40)])
    assert (tmp_path / "x.png").stat().st_size > 100


def test_the_cli_constants_match_the_demo_model():
    from spikeguard.cli import demo as demo_cli
    from spikeguard.demo import model as demo_model

    assert tuple(demo_cli.FAULTS) == tuple(demo_model.FAULTS)
    assert demo_cli.DEFAULT_STEPS == demo_model.DemoSetup.steps
