"""Turning decisions into actions: the recovery policy, its bounds, and presets.

>>> from spikeguard.actuators import RecoveryPolicy
>>> policy = RecoveryPolicy(run_id="r1")
>>> policy.config.apply_lag_steps
1
"""

from spikeguard.actuators.config import PolicyConfig
from spikeguard.actuators.policy import ForeignRunError, RecoveryPolicy
from spikeguard.actuators.presets import PRESETS, Preset, get_preset

__all__ = [
    "PRESETS",
    "ForeignRunError",
    "PolicyConfig",
    "Preset",
    "RecoveryPolicy",
    "get_preset",
]
