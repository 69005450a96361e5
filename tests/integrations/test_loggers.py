"""Actions to TensorBoard (if installed) and W&B (offline mode, if installed), from a real guarded run."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


def _nan_demo(tmp_path, loggers):
    from spikeguard.demo.model import DemoSetup
    from spikeguard.demo.run import DEMO_SETTINGS, run_demo
    from spikeguard.producers.config import GuardConfig
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    runtime = open_runtime(load_settings(DEMO_SETTINGS, env={}))
    config = GuardConfig(
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=20,
        keep_checkpoints=4,
        resume=False,
        lockstep=True,
        data_seed=0,
        healthy_stretch=10,
        loggers=loggers,
    )
    try:
        return run_demo("nan", seed=0, setup=DemoSetup(steps=120), runtime=runtime, config=config)
    finally:
        runtime.close()


def test_actions_go_to_tensorboard_at_the_step_they_were_taken(tmp_path, monkeypatch):
    if not _installed("tensorboard"):
        pytest.skip(
            "the tensorboard package is not installed in this venv (pip install tensorboard)"
        )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)  # SummaryWriter's default runs/ directory
    outcome = _nan_demo(tmp_path, ["tensorboard"])
    assert outcome.rollbacks == 1
    (run_dir,) = (tmp_path / "runs").iterdir()
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    rollback = [a for a in outcome.actions if a["kind"] == "rollback"][0]
    (point,) = events.Scalars("spikeguard/applied/rollback")
    assert point.value == 1 and point.step == rollback["step"]  # the step it left, not the target
    assert "spikeguard/applied/skip_batches" in events.Tags()["scalars"]
    texts = events.Tensors("spikeguard/actions/text_summary")
    said = [t.tensor_proto.string_val[0].decode() for t in texts]
    assert any(
        s.startswith(f"spikeguard: rollback at step {rollback['step']}: rolled back to step")
        for s in said
    )


def test_a_missing_logger_is_said_and_training_goes_on(tmp_path, caplog):
    if _installed("wandb"):
        pytest.skip("wandb is installed: this is the case without it")
    outcome = _nan_demo(tmp_path, ["wandb"])
    assert outcome.rollbacks == 1  # recovered as without the logger
    assert "loggers=['wandb'] but wandb is not installed" in caplog.text


def test_actions_go_to_an_offline_wandb_run(tmp_path, monkeypatch):
    if not _installed("wandb"):
        pytest.skip("wandb is not installed in this venv (pip install wandb)")
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run = wandb.init(project="spikeguard-test")
    try:
        outcome = _nan_demo(tmp_path, ["wandb"])
        run.log({"loss": 1.0})  # the user's own row: spikeguard's keys joined it (commit=False)
        assert outcome.rollbacks == 1
        assert run.summary["spikeguard/applied/rollback"] == 1
    finally:
        run.finish()


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
