"""What runs inside the trainer: the Guard, step statistics, checkpoints, data position, actions.

>>> from spikeguard.producers import Guard, GuardConfig   # doctest: +SKIP
"""

from spikeguard.producers.actions import ActionQueue, apply_action, set_optimizer_eps
from spikeguard.producers.checkpoints import CheckpointInfo, CheckpointStore, checkpoint_id
from spikeguard.producers.config import GuardConfig
from spikeguard.producers.data import GuardedLoader
from spikeguard.producers.guard import Guard
from spikeguard.producers.publisher import BackgroundPublisher
from spikeguard.producers.stats import GradStats, StepStats

__all__ = [
    "ActionQueue",
    "BackgroundPublisher",
    "CheckpointInfo",
    "CheckpointStore",
    "GradStats",
    "Guard",
    "GuardConfig",
    "GuardedLoader",
    "StepStats",
    "apply_action",
    "checkpoint_id",
    "set_optimizer_eps",
]
