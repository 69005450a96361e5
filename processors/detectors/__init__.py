"""The detectors by name, and their config models.

``DETECTORS[name](CONFIGS[name]())`` builds one; each judges one run. All
four are imported plainly: a missing or half-written detector module is an
import error here, never a detector that quietly is not there.
"""

from __future__ import annotations

from pydantic import BaseModel

from spikeguard.processors.detectors.base import Detector
from spikeguard.processors.detectors.ml import MLConfig, MLDetector
from spikeguard.processors.detectors.predictor import PredictorConfig, PredictorDetector
from spikeguard.processors.detectors.rules import RulesConfig, RulesDetector
from spikeguard.processors.detectors.statistical import StatisticalConfig, StatisticalDetector

DETECTORS: dict[str, type[Detector]] = {
    "statistical": StatisticalDetector,
    "rules": RulesDetector,
    "ml": MLDetector,
    "predictor": PredictorDetector,
}
CONFIGS: dict[str, type[BaseModel]] = {
    "statistical": StatisticalConfig,
    "rules": RulesConfig,
    "ml": MLConfig,
    "predictor": PredictorConfig,
}

__all__ = ["CONFIGS", "DETECTORS", "Detector"]
