"""What a run promises the pipeline, checked when the Guard is built (as torchtitan checks its config).

The plan is the Guard's settings plus the run's recovery policy: a preset
(``Guard(..., preset="large")``, ``GuardConfig(preset=...)`` or the
``SPIKEGUARD_PRESET`` environment variable, in that order) and policy
overrides on top of it, validated as a :class:`PolicyConfig` (and, under the
key ``"fusion"``, FusionConfig overrides for the run's fusion). The Guard
publishes it on the compacted ``runs`` topic (RunEvent) so fusion and the
actuator use the run's own settings, wherever they run.

Settings that depend on each other are checked here, with the reason:
a rollback must find a healthy checkpoint at least
``rollback_min_steps_before_onset`` steps before an incident's onset, and it
is decided ``detection_delay_steps`` after the onset; by then the checkpoints
still on disk reach back ``(keep_checkpoints - 1) * checkpoint_every`` steps.
So ``(keep - 1) * every >= min distance + detection delay``. When the run
names its policy (a preset or overrides) an inconsistent plan is refused;
without one the pipeline applies its own defaults, which the trainer cannot
see, and the same check against PolicyConfig's defaults only warns.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from spikeguard.errors import ConfigError
from spikeguard.producers.config import GuardConfig

log = logging.getLogger("spikeguard.producers.guard")


@dataclass(frozen=True)
class RunPlan:
    config: GuardConfig  # with the preset's checkpoint interval applied
    preset: str | None
    policy: dict[str, Any] = field(default_factory=dict)  # overrides only (over the preset)
    min_rollback_steps: int = 0
    fusion: dict[str, Any] = field(
        default_factory=dict
    )  # FusionConfig overrides (policy["fusion"])

    @property
    def reach(self) -> int:
        """How far back the kept periodic checkpoints are sure to reach, in steps."""
        return (self.config.keep_checkpoints - 1) * self.config.checkpoint_every


def make_plan(
    cfg: GuardConfig, preset: str | None = None, policy: dict[str, Any] | None = None
) -> RunPlan:
    """The run's plan, or ConfigError naming the settings that do not fit together, and why."""
    from spikeguard.actuators.presets import get_preset  # the policy's own models, not a copy

    name = preset or cfg.preset or os.environ.get("SPIKEGUARD_PRESET") or None
    overrides = {**cfg.policy, **(policy or {})}
    fusion = _fusion_overrides(overrides.pop("fusion", None) or {})
    chosen = get_preset(name) if name else None  # ConfigError for an unknown name
    try:
        full = chosen.policy_config(**overrides) if chosen else _policy_config(overrides)
    except ValidationError as exc:
        raise ConfigError(
            f"policy overrides of run do not validate as PolicyConfig: {exc}"
        ) from exc
    if chosen is not None and "checkpoint_every" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"checkpoint_every": chosen.checkpoint_interval_steps})
    plan = RunPlan(cfg, name, overrides, full.rollback_min_steps_before_onset, fusion)
    problem = check(plan)
    if problem and (name or overrides):
        raise ConfigError(problem)
    if problem:
        log.warning(
            "spikeguard: %s (the pipeline's own policy decides; name the run's policy with "
            "preset= or policy= to have this checked)",
            problem,
        )
    return plan


def check(plan: RunPlan) -> str | None:
    """The reason the plan cannot work, or None."""
    from spikeguard.actuators.run_settings import cadence_problem  # the actuator checks the same

    cfg = plan.config
    return cadence_problem(
        cfg.checkpoint_every,
        cfg.keep_checkpoints,
        cfg.detection_delay_steps,
        plan.min_rollback_steps,
    )


def _fusion_overrides(overrides: Any) -> dict[str, Any]:
    """``policy["fusion"]``: FusionConfig overrides for the run, checked here as fusion will."""
    from spikeguard.processors.fusion_config import FusionConfig

    try:
        FusionConfig.model_validate(dict(overrides))
    except (ValidationError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"policy['fusion'] of run does not validate as FusionConfig: {exc}"
        ) from exc
    return dict(overrides)


def _policy_config(overrides: dict[str, Any]) -> Any:
    from spikeguard.actuators.config import PolicyConfig

    return PolicyConfig(**overrides)
