"""What runs inside the trainer: the Guard, step statistics, checkpoints, data position, actions.

>>> from spikeguard.producers import Guard, GuardConfig   # doctest: +SKIP

Names load on first use: the workers read ``GuardConfig`` through the
settings and must not pay for importing torch.
"""

from importlib import import_module

_HOME = {
    "ActionQueue": "actions",
    "apply_action": "actions",
    "set_optimizer_eps": "actions",
    "CheckpointInfo": "checkpoints",
    "CheckpointStore": "checkpoints",
    "checkpoint_id": "checkpoints",
    "GuardConfig": "config",
    "GuardedLoader": "data",
    "Guard": "guard",
    "BackgroundPublisher": "publisher",
    "GradStats": "stats",
    "StepStats": "stats",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
