"""A run's recovery policy from its RunEvent: its preset, its overrides, its checkpoint cadence.

The run's policy is its preset's (``actuators/presets.py``) with its overrides
on top, exactly what the Guard checked its checkpoint settings against; a run
that names overrides but no preset gets them over the actuator's own policy
(``settings.policy``), and a run that names neither gets that policy as is.

The cadence check is the Guard's (``producers/run_plan.py`` calls
:func:`cadence_problem`): the checkpoints a run keeps must reach
``rollback_min_steps_before_onset + detection_delay_steps`` back, or a
rollback finds no target. The Guard can only check it against the policy it
knows; the actuator knows the policy it applies, and warns the run (an ALERT)
when that one does not fit the run's cadence.
"""

from __future__ import annotations

from typing import Any

from spikeguard.actuators.config import PolicyConfig
from spikeguard.actuators.presets import PRESETS
from spikeguard.errors import RunSettingsRejected
from spikeguard.streaming.run_settings_stage import over, validated
from spikeguard.schemas import RunEvent


def given_policy(event: RunEvent) -> dict[str, Any]:
    """The fields of a RunEvent the actuator applies (empty: the run names no policy and is
    not in lockstep; a lockstep run is pulsed at every decision)."""
    given: dict[str, Any] = {}
    if event.preset:
        given["preset"] = event.preset
    if event.policy:
        given["policy"] = dict(event.policy)
    if event.lockstep:
        given["lockstep"] = True
    return given


def run_policy(run_id: str, given: dict[str, Any], defaults: PolicyConfig) -> PolicyConfig:
    """The run's PolicyConfig, or RunSettingsRejected naming what does not validate."""
    overrides = given.get("policy", {})
    name = given.get("preset")
    if name:
        preset = PRESETS.get(name)
        if preset is None:
            raise RunSettingsRejected(
                f"run {run_id}: unknown preset {name!r} (known: "
                f"{', '.join(PRESETS)}); the run keeps this stage's defaults"
            )
        return validated(PolicyConfig, {**preset.policy, **overrides}, "policy overrides", run_id)
    return over(defaults, overrides, "policy overrides", run_id)


def cadence_problem(
    checkpoint_every: int,
    keep_checkpoints: int,
    detection_delay_steps: int,
    min_rollback_steps: int,
) -> str | None:
    """Why periodic checkpoints this far apart, this many kept, leave a rollback no target (None: they do not)."""
    if checkpoint_every <= 0:
        return None  # only on-demand checkpoints: the policy asks for them itself
    reach = (keep_checkpoints - 1) * checkpoint_every
    need = min_rollback_steps + detection_delay_steps
    if reach >= need:
        return None
    return (
        f"keep_checkpoints={keep_checkpoints} x checkpoint_every={checkpoint_every} keeps "
        f"checkpoints only {reach} steps back ((keep - 1) x every), but a rollback needs one "
        f"rollback_min_steps_before_onset={min_rollback_steps} steps before an onset found "
        f"detection_delay_steps={detection_delay_steps} later ({need} steps): raise "
        f"keep_checkpoints to {-(-need // checkpoint_every) + 1} or checkpoint_every to "
        f"{-(-need // max(1, keep_checkpoints - 1))}"
    )
