"""Model profiles: the policy's thresholds and the Guard's checkpoint cadence per model size.

A preset holds only what the code uses: ``checkpoint_interval_steps`` (the
Guard's ``checkpoint_every`` when the run does not set it) and the ``policy``
overrides that turn into a :class:`PolicyConfig`. The run's own learning
rate, warm-up and clipping stay the user's (the policy only ever sends
factors relative to them). Sources, loosely: GPT-2/GPT-3 and LLaMA runs per
size, and PaLM's recovery (restart ~100 steps before a spike, skip 200-500
batches). Larger models checkpoint more often in steps because a
lost step costs more, wait longer before trusting a recovered LR, and skip
a wider margin past the anomalous batches (PaLM skipped 200-500 batches; a
skip here follows the evidence instead: the anomalous window plus this margin).

>>> get_preset("small").policy_config().rollback_min_steps_before_onset
30
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from spikeguard.actuators.config import PolicyConfig
from spikeguard.errors import ConfigError


class Preset(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str
    checkpoint_interval_steps: int = Field(
        ge=1, description="periodic checkpoints (GuardConfig.checkpoint_every)"
    )
    policy: dict[str, Any] = Field(default_factory=dict, description="PolicyConfig overrides")

    def policy_config(self, **overrides: Any) -> PolicyConfig:
        """The preset's PolicyConfig; ``overrides`` win over the preset's values."""
        return PolicyConfig(**{**self.policy, **overrides})

    def as_dict(self) -> dict[str, Any]:
        """Everything, with the policy given in full (preset values over defaults)."""
        policy = self.policy_config().model_dump(mode="json")
        return {**self.model_dump(exclude={"policy"}), "policy": policy}


PRESETS: dict[str, Preset] = {
    "small": Preset(
        name="small",
        description="up to ~150M parameters (GPT-2 small class): fast steps, cheap rollbacks",
        checkpoint_interval_steps=200,
        policy=dict(
            clip_norm_initial=1.0,
            spike_patience_steps=3,
            lr_decrease_factor_explosion=0.5,
            lr_restore_healthy_steps=100,
            min_lr_factor=0.1,
            rollback_min_steps_before_onset=30,
            skip_extra_batches=2,
            rollback_window_steps=1000,
            max_rollbacks_in_window=3,
            divergence_step_interval_steps=20,
            preventive_min_interval_steps=50,
        ),
    ),
    "medium": Preset(
        name="medium",
        description="~350M-3B parameters (GPT-3 medium/XL class); the PolicyConfig defaults",
        checkpoint_interval_steps=100,
        policy={},
    ),
    "large": Preset(
        name="large",
        description="7B parameters and up (LLaMA/PaLM class): expensive steps, cautious recovery",
        checkpoint_interval_steps=50,
        policy=dict(
            clip_norm_initial=1.0,
            spike_patience_steps=5,
            lr_decrease_factor_explosion=0.3,
            lr_restore_factor=1.15,
            lr_restore_healthy_steps=500,
            min_lr_factor=0.02,
            rollback_min_steps_before_onset=100,
            skip_extra_batches=8,
            rollback_window_steps=5000,
            max_rollbacks_in_window=3,
            divergence_step_interval_steps=50,
            preventive_min_interval_steps=200,
        ),
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
