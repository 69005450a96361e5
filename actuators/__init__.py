"""Turning decisions into actions: the recovery policy, its bounds, presets and action signing.

>>> from spikeguard.actuators import RecoveryPolicy
>>> policy = RecoveryPolicy(run_id="r1")
>>> policy.config.apply_lag_steps
1
"""

from spikeguard.actuators.config import PolicyConfig
from spikeguard.actuators.policy import ForeignRunError, RecoveryPolicy
from spikeguard.actuators.presets import PRESETS, Preset, get_preset
from spikeguard.actuators.signing import sign_action, verify_action

__all__ = [
    "PRESETS",
    "ForeignRunError",
    "PolicyConfig",
    "Preset",
    "RecoveryPolicy",
    "get_preset",
    "sign_action",
    "verify_action",
]
