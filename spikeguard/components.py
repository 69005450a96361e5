"""The pipeline's components by name, built from settings.

``spikeguard worker NAME`` runs one of these; the embedded runtime and the
backtest run all of them. Detectors, fusion and policy get their own config
section; nothing here knows which bus will run them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spikeguard.schemas import Topics

if TYPE_CHECKING:
    from pydantic import SecretStr

    from spikeguard.processors.detector_stage import DetectorStage
    from spikeguard.settings import Settings
    from spikeguard.streaming.stage import Stage

DETECTOR_NAMES = ("statistical", "rules", "ml", "predictor")
COMPONENTS = (*DETECTOR_NAMES, "fusion", "actuator")
#: The four detectors in one worker (``spikeguard worker detectors``): a step consumed once,
#: its verdicts sent as one signed record, read by fusion together and in detector order.
COHOSTED = "detectors"
#: What the embedded runtime runs: the detectors co-hosted (a step's verdicts reach fusion as
#: the backtest hands them over, so a critical verdict decides with the same verdicts), then
#: fusion and the actuator.
EMBEDDED_COMPONENTS = (COHOSTED, "fusion", "actuator")


def build_stage(name: str, settings: "Settings", topics: Topics | None = None) -> "Stage":
    # Imported here so that naming the components (the CLI's --help) stays cheap.
    from spikeguard.actuators.policy import RecoveryPolicy
    from spikeguard.actuators.actuator_stage import ActuatorStage
    from spikeguard.processors.fusion import Fusion
    from spikeguard.processors.fusion_stage import FusionStage
    from spikeguard.streaming.run_clock import RunClock

    topics = topics or Topics(settings.topic_prefix)
    gaps = {
        "max_step_gap": settings.worker.max_step_gap,
        "max_epoch_gap": settings.worker.max_epoch_gap,
    }
    if name in DETECTOR_NAMES:
        return detector_stage(name, settings, topics)
    if name == COHOSTED:
        from spikeguard.processors.cohosted_stage import CoHostedDetectors

        return CoHostedDetectors([detector_stage(n, settings, topics) for n in DETECTOR_NAMES])
    if name == "fusion":
        # A run's own settings (its RunEvent) come as ``config``; the stage's are the default.
        # The key authenticates the verdicts it decides on and the run events whose settings it
        # applies (no key: taken as they come); the run clock bounds how far a record may jump.
        return FusionStage(
            topics,
            lambda run_id, config=None: Fusion(config or settings.fusion, run_id=run_id),
            defaults=settings.fusion,
            signing_key=_stage_key(settings),
            clock=RunClock(**gaps),
        )
    if name == "actuator":
        return ActuatorStage(
            topics,
            lambda run_id, config=None: RecoveryPolicy(config or settings.policy, run_id=run_id),
            signing_key=_stage_key(settings),
            defaults=settings.policy,
            clock=RunClock(**gaps),
            # A live pipeline (a key, or an explicit --insecure) tells each trainer it is judged;
            # a backtest or replay has no trainer to tell, and stays deterministic.
            pulse_interval_s=settings.worker.pulse_interval_s
            if settings.keys() is not None or settings.insecure
            else None,
        )
    raise ValueError(f"unknown component {name!r}; known: {', '.join((*COMPONENTS, COHOSTED))}")


def detector_stage(name: str, settings: "Settings", topics: Topics) -> "DetectorStage":
    """The stage of detector ``name`` (one of :data:`DETECTOR_NAMES`), its config from settings."""
    stage = _bare_detector_stage(name, settings, topics)
    stage.max_step_gap = settings.worker.max_step_gap
    stage.max_epoch_gap = settings.worker.max_epoch_gap
    return stage


def _bare_detector_stage(name: str, settings: "Settings", topics: Topics) -> "DetectorStage":
    from spikeguard.processors.detector_stage import DetectorStage
    from spikeguard.processors.detectors.base import Detector
    from spikeguard.processors.detectors.ml import MLDetector
    from spikeguard.processors.detectors.predictor import PredictorDetector
    from spikeguard.processors.detectors.rules import RulesDetector
    from spikeguard.processors.detectors.statistical import StatisticalDetector

    if name == "ml":  # the detector stage, plus releasing quiet runs' forests
        from spikeguard.processors.detectors.ml.stage import MLStage

        return MLStage(
            topics,
            lambda run_id: MLDetector(settings.ml),
            settings.ml.release_idle_s,
            signing_key=_stage_key(settings),
        )

    def detector(run_id: str) -> Detector:
        if name == "statistical":
            return StatisticalDetector(settings.statistical)
        if name == "rules":
            return RulesDetector(settings.rules)
        return PredictorDetector(settings.predictor)

    if name not in DETECTOR_NAMES:
        raise ValueError(f"unknown detector {name!r}; known: {', '.join(DETECTOR_NAMES)}")
    return DetectorStage(topics, name, detector, signing_key=_stage_key(settings))


def _stage_key(settings: "Settings") -> "SecretStr | None":
    """The key the stages authenticate and sign with: the shared key or a keyring of role keys.

    The stages annotate it ``SecretStr``, but hand it only to ``authenticate``, ``sign`` and
    ``Signer``, which take a :class:`~spikeguard.schemas.signing.Keyring` too (``SigningKey``):
    their annotation (processors/, actuators/) is the one to widen, not the key.
    """
    return settings.keys()  # type: ignore[return-value]
