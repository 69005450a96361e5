"""The Guard both real forensics runs train under: the demo's lockstep setup on an embedded runtime."""

from __future__ import annotations

from typing import Any


def lockstep_guard(runtime: Any, model: Any, optimizer: Any, tmp_path, run_id: str, **config: Any):
    """A Guard on ``runtime``'s bus, signing with its key and following its policy; a checkpoint
    every 20 steps (4 kept) in ``tmp_path / "ck"``, lockstep, data seed 0; ``config`` on top."""
    from spikeguard import Guard
    from spikeguard.producers.config import GuardConfig

    cfg = GuardConfig(
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=20,
        keep_checkpoints=4,
        resume=False,
        lockstep=True,
        data_seed=0,
        healthy_stretch=10,
        **config,
    )
    return Guard(
        model,
        optimizer,
        None,
        run_id=run_id,
        runtime=runtime,
        config=cfg,
        policy=runtime.settings.policy.model_dump(mode="json", exclude_defaults=True),
    )
