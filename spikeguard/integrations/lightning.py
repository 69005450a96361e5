"""spikeguard inside a Lightning ``Trainer``: one callback.

    from spikeguard.integrations.lightning import SpikeguardCallback
    trainer = L.Trainer(max_steps=1000, callbacks=[SpikeguardCallback(run_id="my-run")])
    trainer.fit(module, loader)

Like ZClip's Lightning callback it uses public hooks only:

- ``on_before_backward`` hands over each micro-batch's loss (Lightning has
  already divided it by ``accumulate_grad_batches``: they add up to the
  step's mean); ``on_train_batch_start`` counts the batches read.
- ``on_before_optimizer_step`` (after the backward and the unscaling, before
  Lightning's own gradient clipping and the optimizer's math) is the first
  half of a guarded step (producers/external_loop.py): statistics, actions
  due, local skip rule. A skipped update sets every gradient to ``None``, so
  the optimizer leaves the parameters, its moments and its step count alone.
- ``on_train_batch_end`` (after the optimizer and a step-interval scheduler
  stepped) is the second half: StepEvent, checkpoints, rollback, stop.
- ``stop`` sets ``trainer.should_stop``: Lightning ends the fit cleanly.
- ``state_dict`` / ``load_state_dict`` put the Guard's own state (LR factor,
  clipping, applied-action ids, skip windows) into Lightning's checkpoints.

``mode`` ("protect", "observe", "skip-only") and ``resume`` ("auto", "must",
"never") are the plain Guard's, with the same defaults; Lightning resumes the
model, and the Guard's own state rides in Lightning's checkpoints.

Step numbers are ``trainer.global_step``. Lightning gives a callback no way
to set it, so after a rollback the count goes on (the run's next rollback generation,
``epoch`` in its events, marks it) while model, optimizer, scheduler and RNG are the
checkpoint's; ``max_steps`` then counts the rolled-back steps too. The data
goes on with the batch after the last one read (Lightning's iterator cannot be
rewound from a callback): the batches that led into the trouble are not read
again. Automatic optimization with one optimizer only.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from spikeguard.errors import ConfigError
from spikeguard.integrations.callback import GuardedCallback
from spikeguard.producers.external_loop import mean_loss

log = logging.getLogger(__name__)

#: The Guard's parts that Lightning's own checkpoint does not already hold.
OWN_PARTS = ("lr", "clip", "health", "ledger", "skip_rule", "data")


class SpikeguardCallback(GuardedCallback, Callback):
    """Guards a Lightning fit; ``guard_kwargs`` go to the Guard (runtime, preset, policy, ...)."""

    #: A Lightning checkpoint's state for the Guard, loaded before training starts.
    _restored: dict[str, Any] | None = None

    # -- Lightning hooks -------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not pl_module.automatic_optimization or len(trainer.optimizers) != 1:
            raise ConfigError(
                "spikeguard's Lightning callback needs automatic optimization with one optimizer"
            )
        configs = trainer.lr_scheduler_configs
        scheduler = configs[0].scheduler if configs else None
        guard = self._start_guard(
            pl_module,
            trainer.optimizers[0],
            scheduler,
            root_dir=trainer.default_root_dir,
            # The precision plugin's GradScaler (16-mixed): its gradients are unscaled before
            # this callback's first half, and its overflows are its own skips, as under Guard.step.
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            step=trainer.global_step,
            max_steps=trainer.max_steps if trainer.max_steps > 0 else None,
            batches_per_step=trainer.accumulate_grad_batches,
        )
        if self._restored is not None:  # resumed from a Lightning checkpoint
            guard.generation = max(guard.generation, _generation(self._restored))
            guard.parts.load_state_dict(self._restored.get("parts", {}))
            self._restored = None

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.guard is not None:
            self.guard.batch_read()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.guard is None:
            return
        losses = self._step_losses()
        self.guard.before_update(mean_loss(losses, summed=True), step=trainer.global_step)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        guard = self.guard
        if guard is None or not guard.after_update().interrupted:
            return
        if guard.should_stop:
            log.warning(
                "spikeguard: stopping training at step %d: %s",
                trainer.global_step,
                guard.stop_reason,
            )
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close_guard(trainer.global_step, trainer.max_steps)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.guard is not None:
            self.guard.close(finished=False)

    # -- Lightning checkpoints -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.guard is None:
            return {}
        return {
            "generation": self.guard.generation,
            "parts": {
                n: self.guard.parts[n].state_dict() for n in OWN_PARTS if n in self.guard.parts
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.guard is None:
            self._restored = dict(state_dict)  # the guard is built when training starts
            return
        self.guard.generation = max(self.guard.generation, _generation(state_dict))
        self.guard.parts.load_state_dict(state_dict.get("parts", {}))


def _generation(state: dict[str, Any]) -> int:
    """The rollback generation a Lightning checkpoint holds (saved as "epoch" by earlier versions)."""
    return int(state.get("generation", state.get("epoch", 0)))
