"""spikeguard inside a HuggingFace ``Trainer``: one callback.

    from spikeguard.integrations.hf import SpikeguardCallback
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[SpikeguardCallback(run_id="my-run")])
    trainer.train()

What it does, through the Trainer's public callback events only:

- ``on_pre_optimizer_step`` / ``on_step_end`` drive the two halves of a
  guarded step (producers/external_loop.py); the step number is
  ``state.global_step``.
- The step's loss is read from the model's own output (a forward hook on the
  model: ``output.loss`` of each training micro-batch), because the Trainer
  hands callbacks no loss. A model that returns no loss (a custom
  ``compute_loss``) can hand it over with :meth:`SpikeguardCallback.record_loss`.
- A skipped update really is skipped: every gradient is set to ``None`` before
  the Trainer's ``optimizer.step()``, which AdamW then leaves alone (moments,
  weight decay, step count). The Trainer still steps its scheduler, as the
  plain Guard does for a skipped update.
- A rollback restores model, optimizer, scheduler and RNG state from the
  Guard's checkpoint and sets ``state.global_step`` back to the checkpoint's
  step, so the scheduler and the step numbers agree. The Trainer's data goes
  on with the batch after the last one read (its iterator cannot be rewound
  from a callback): the rolled-back stretch's batches, the ones that led into
  the trouble, are not read again. Batches the Trainer has yet to read that
  fall in a skip window (counted in the Trainer's own batch order) void the
  updates of the steps that read them.
- LR actions scale the scheduler's value around the optimizer step (torch
  step hooks): the schedule goes on underneath.
- ``stop`` sets ``control.should_training_stop``: the Trainer ends cleanly.

``mode`` ("protect", "observe", "skip-only") and ``resume`` ("auto", "must",
"never") are the plain Guard's (producers/config.py), with the same defaults.
The Trainer resumes the model itself; with ``resume="auto"`` the Guard's own
facts (applied action ids, skip windows, LR factor) follow a Trainer that
resumed, and a Trainer that starts at step 0 starts the Guard afresh.

The Trainer clips gradients (``max_grad_norm``, 1.0 by default) *before*
``on_pre_optimizer_step``, so with clipping on the gradient norm the Guard
sees is the clipped one; ``max_grad_norm=0`` leaves clipping to the Guard
(CLIP actions) and its statistics unclipped.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback

from spikeguard.errors import SpikeguardError
from spikeguard.integrations.callback import GuardedCallback
from spikeguard.producers.external_loop import mean_loss

log = logging.getLogger(__name__)


class SpikeguardCallback(GuardedCallback, TrainerCallback):
    """Guards a ``transformers.Trainer`` run; ``guard_kwargs`` go to the Guard (runtime, preset, policy, ...)."""

    _summed = False  # the model normalised its loss by the whole step's item count
    _hook: Any = None  # the forward hook on the model that reads its loss

    # -- what the user may call ------------------------------------------------
    def record_loss(self, loss: torch.Tensor) -> None:
        """Hand over a micro-batch's loss when the model's output carries none."""
        self._losses.append(loss.detach())

    # -- Trainer events --------------------------------------------------------
    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        **_: Any,
    ) -> None:
        if self.guard is not None:
            self.guard.close(finished=False)  # a second train() call: a new guarded stretch
        # The Trainer resumes the model itself (resume_from_checkpoint); the Guard's own facts
        # follow it as ``resume`` says (FrameworkGuard.resume). A Trainer resumed at step n
        # skips n x accumulation batches of its data (its sampler state, skip_first_batches).
        self._start_guard(
            model,
            optimizer,
            lr_scheduler,
            root_dir=args.output_dir,
            scaler=getattr(optimizer, "scaler", None),  # accelerate's fp16
            step=state.global_step,
            max_steps=state.max_steps,
            batches_per_step=args.gradient_accumulation_steps,
        )
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        if args.max_grad_norm and args.max_grad_norm > 0:
            log.info(
                "spikeguard: the Trainer clips gradients at max_grad_norm=%g before its callbacks "
                "run, so the gradient norms published are the clipped ones; max_grad_norm=0 leaves "
                "clipping to spikeguard",
                args.max_grad_norm,
            )

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.guard is None:
            return
        losses = self._step_losses()
        if not losses:
            raise SpikeguardError(
                "spikeguard: no training loss seen this step: the model's output has "
                "no .loss; call SpikeguardCallback.record_loss(loss) from compute_loss"
            )
        self.guard.before_update(mean_loss(losses, self._summed), step=state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        guard = self.guard
        if guard is None or not guard.after_update().interrupted:
            return
        if guard.rolled_back:
            if state.max_steps > 0 and state.global_step >= state.max_steps:
                control.should_training_stop = False  # the flow callback saw the old last step
            state.global_step = guard.step_count  # the checkpoint's step: scheduler and steps agree
        if guard.should_stop:
            log.warning(
                "spikeguard: stopping training at step %d: %s", state.global_step, guard.stop_reason
            )
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._close_guard(state.global_step, state.max_steps)

    # -- internals -------------------------------------------------------------
    def _on_forward(self, module: torch.nn.Module, args: Any, kwargs: dict, output: Any) -> None:
        if not module.training or self.guard is None:
            return  # evaluation
        self.guard.batch_read()
        loss = output.get("loss") if hasattr(output, "get") else None
        if loss is not None:
            # With num_items_in_batch the model divided by the whole step's item count:
            # the micro-batches' losses add up to the step's mean.
            self._summed = kwargs.get("num_items_in_batch") is not None
            self._losses.append(loss.detach())
