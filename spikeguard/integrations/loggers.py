"""Actions where users already look: TensorBoard and Weights & Biases, if installed.

``GuardConfig(loggers=["tensorboard", "wandb"])`` (opt-in; no new dependency):
every action the Guard takes or withholds also goes to

- TensorBoard (``torch.utils.tensorboard.SummaryWriter``, needs the
  ``tensorboard`` package): a scalar ``spikeguard/applied/<kind>`` or
  ``spikeguard/withheld/<kind>`` (how many so far) and a text entry
  ``spikeguard/actions`` with the WARNING line's words, at the Guard's step;
- W&B (``wandb.log``, when ``wandb`` is importable and a run is active): the
  same counts under ``spikeguard/`` keys and ``spikeguard/step``, logged with
  ``commit=False`` so they join the user's own next row (a rollback moves the
  Guard's step back, and W&B drops rows whose step goes back).

A logger that is missing or fails is said once and dropped: it never stops training.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterable

from spikeguard.producers.narration import ActionLogger, send
from spikeguard.schemas import Action

__all__ = ["ActionLogger", "TensorBoardLogger", "WandbLogger", "loggers_from", "send"]

log = logging.getLogger(__name__)


class TensorBoardLogger:
    """Actions as TensorBoard scalars and text (``log_dir``: SummaryWriter's, default ``runs/``)."""

    def __init__(self, writer: Any = None, log_dir: str | None = None) -> None:
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            writer = SummaryWriter(log_dir=log_dir)
        self.writer = writer
        self.counts: Counter[str] = Counter()

    def action(self, step: int, action: Action, applied: bool, text: str) -> None:
        key = f"spikeguard/{'applied' if applied else 'withheld'}/{action.kind.value}"
        self.counts[key] += 1
        self.writer.add_scalar(key, self.counts[key], step)
        self.writer.add_text("spikeguard/actions", text, step)
        self.writer.flush()  # actions are rare, and a crash right after one is when they matter


class WandbLogger:
    """Actions into the active W&B run, under ``spikeguard/`` keys."""

    def __init__(self, wandb: Any) -> None:
        self.wandb = wandb
        self.counts: Counter[str] = Counter()

    def action(self, step: int, action: Action, applied: bool, text: str) -> None:
        key = f"spikeguard/{'applied' if applied else 'withheld'}/{action.kind.value}"
        self.counts[key] += 1
        self.wandb.log(
            {key: self.counts[key], "spikeguard/step": step, "spikeguard/action": text},
            commit=False,
        )


def loggers_from(names: Iterable[str]) -> list[ActionLogger]:
    """The loggers ``GuardConfig.loggers`` names that can run here; each missing one said once."""
    found: list[ActionLogger] = []
    for name in names:
        if name == "tensorboard":
            try:
                found.append(TensorBoardLogger())
            except ImportError as exc:
                log.warning(
                    "spikeguard: loggers=['tensorboard'] but TensorBoard is not usable (%s): "
                    "pip install tensorboard; actions are not sent there",
                    exc,
                )
        elif name == "wandb":
            try:
                import wandb
            except ImportError:
                log.warning(
                    "spikeguard: loggers=['wandb'] but wandb is not installed; actions are "
                    "not sent there"
                )
                continue
            if wandb.run is None:
                log.warning(
                    "spikeguard: loggers=['wandb'] but no W&B run is active (wandb.init() "
                    "before the Guard); actions are not sent there"
                )
                continue
            found.append(WandbLogger(wandb))
    return found
