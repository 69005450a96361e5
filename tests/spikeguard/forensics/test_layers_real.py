"""A gradient blow-up injected through one layer of a real guarded run is attributed to that layer."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from forensics_helpers import lockstep_guard  # noqa: E402


def test_the_report_names_the_layer_a_blow_up_went_through(tmp_path):
    from spikeguard.demo.run import DEMO_SETTINGS
    from spikeguard.reporting import build_timeline, load_directory
    from spikeguard.reporting.page import render
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    torch.manual_seed(0)
    runtime = open_runtime(
        load_settings({**DEMO_SETTINGS, "data_dir": str(tmp_path / "bus")}, env={})
    )
    model = torch.nn.Sequential()
    model.add_module("embed", torch.nn.Linear(8, 32))
    model.add_module("act", torch.nn.Tanh())
    model.add_module("hidden", torch.nn.Linear(32, 32))
    model.add_module("act2", torch.nn.Tanh())
    model.add_module("head", torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(4096, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(4096, 1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True
    )
    guard = lockstep_guard(runtime, model, optimizer, tmp_path, "layers")
    blow_at, hook = 120, None
    try:
        for xb, yb in guard.data(loader, max_steps=128):
            if guard.step_count == blow_at and guard.generation == 0 and hook is None:
                hook = model.hidden.weight.register_hook(lambda g: g * 300)  # this layer only
            if guard.step_count == blow_at + 3 and hook is not None:
                hook.remove()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            guard.step(loss)
    finally:
        guard.close()
        runtime.close()

    timeline = build_timeline(load_directory(tmp_path / "bus")["layers"])
    incident = next(i for i in timeline.incidents if blow_at <= i.onset_step <= blow_at + 3)
    first = incident.layers[0]
    assert first["layer"] == "hidden.weight"
    assert first["first_step"] == blow_at and first["norm_ratio"] > 100
    assert all(m["layer"].startswith("hidden") for m in incident.layers)  # no bystander named
    # Healthy stretches name nobody: incidents before the injection have no layer suspects.
    assert all(not i.layers for i in timeline.incidents if i.onset_step < blow_at)
    assert "hidden.weight: share" in render(timeline)
