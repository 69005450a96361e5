"""What the HF and Lightning callbacks share: the Guard's arguments, then the Guard, and the losses.

Each callback is built with the plain Guard's arguments and builds its
:class:`~spikeguard.producers.external_loop.FrameworkGuard` when training
starts, from what its framework hands it then (model, optimizer, scheduler,
the step a resumed run starts at). Between the two halves of a step it holds
the micro-batches' losses it was handed. The hooks that drive a step are each
framework's own (:mod:`.hf`, :mod:`.lightning`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from spikeguard.producers.config import GuardConfig, GuardMode, ResumeMode
from spikeguard.producers.external_loop import FrameworkGuard


class GuardedCallback:
    """The state of a framework callback; ``guard_kwargs`` go to the Guard (runtime, preset, policy, ...)."""

    def __init__(
        self,
        run_id: str | None = None,
        config: GuardConfig | None = None,
        *,
        mode: GuardMode | str | None = None,
        resume: ResumeMode | str | None = None,
        **guard_kwargs: Any,
    ) -> None:
        super().__init__()
        self.run_id = run_id
        self.config = config
        # As for the plain Guard (None: the config's, "protect" and "auto" by default).
        self.mode, self.resume = mode, resume
        self.guard_kwargs = guard_kwargs
        self.guard: FrameworkGuard | None = None
        self._losses: list[torch.Tensor] = []

    def _start_guard(
        self,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        *,
        root_dir: str,
        scaler: Any,
        step: int,
        max_steps: int | None,
        batches_per_step: int,
    ) -> FrameworkGuard:
        """The Guard of a run that starts (or resumed) at ``step``; checkpoints under ``root_dir``
        unless the config says where. ``scaler``: the framework's GradScaler, if any."""
        config = self.config or GuardConfig(checkpoint_dir=str(Path(root_dir) / "spikeguard"))
        guard = FrameworkGuard(
            model,
            optimizer,
            scheduler,
            run_id=self.run_id,
            config=config,
            mode=self.mode,
            resume=self.resume,
            framework_step=step,
            **{"scaler": scaler, **self.guard_kwargs},
        )
        self.guard = guard
        guard.max_steps = max_steps
        guard.step_count = step
        # Resumed at ``step``: the framework skips the batches its first run read, and so does
        # the batch count.
        guard.stream.position = max(guard.stream.position, step * batches_per_step)
        return guard

    def _step_losses(self) -> list[torch.Tensor]:
        """The losses handed over since the last step's first half (and forget them)."""
        losses, self._losses = self._losses, []
        return losses

    def _close_guard(self, step: int, max_steps: int) -> None:
        """Close the Guard at the end of training: finished if it reached ``max_steps``."""
        if self.guard is not None:
            done = max_steps > 0 and step >= max_steps
            self.guard.close(finished=done and not self.guard.should_stop)
