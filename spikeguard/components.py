"""The pipeline's components by name, built from settings.

``spikeguard worker NAME`` runs one of these; the embedded runtime and the
backtest run all of them. Detectors, fusion and policy get their own config
section; nothing here knows which bus will run them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spikeguard.schemas import Topics

if TYPE_CHECKING:
    from spikeguard.streaming.stage import Stage
    from spikeguard.settings import Settings

DETECTOR_NAMES = ("statistical", "rules", "ml", "predictor")
COMPONENTS = (*DETECTOR_NAMES, "fusion", "actuator")


def build_stage(name: str, settings: "Settings", topics: Topics | None = None) -> "Stage":
    # Imported here so that naming the components (the CLI's --help) stays cheap.
    from spikeguard.actuators.policy import RecoveryPolicy
    from spikeguard.actuators.actuator_stage import ActuatorStage
    from spikeguard.processors.detectors import DETECTORS
    from spikeguard.processors.fusion import Fusion
    from spikeguard.processors.detector_stage import DetectorStage
    from spikeguard.processors.fusion_stage import FusionStage

    topics = topics or Topics(settings.topic_prefix)
    if name in DETECTOR_NAMES:
        detector_cls = DETECTORS[name]
        config = getattr(settings, name)
        return DetectorStage(topics, name, lambda run_id: detector_cls(config),
                             signing_key=settings.signing_key)
    if name == "fusion":
        return FusionStage(topics, lambda run_id: Fusion(settings.fusion, run_id=run_id))
    if name == "actuator":
        return ActuatorStage(
            topics,
            lambda run_id: RecoveryPolicy(settings.policy, run_id=run_id),
            signing_key=settings.signing_key,
        )
    raise ValueError(f"unknown component {name!r}; known: {', '.join(COMPONENTS)}")
