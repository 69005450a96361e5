"""The ``ml`` detector: layer shares and a per-run isolation forest (see :mod:`.detector`).

The package's parts: :mod:`.config` (settings), :mod:`.detector` (the detector
and its per-run state), :mod:`.batch` (a batch's rows computed ahead),
:mod:`.forest` (the compiled isolation forest), :mod:`.layers` (layer-share
baselines), :mod:`.rows` (row storage) and :mod:`.stage` (the worker's stage).
"""

from __future__ import annotations

from spikeguard.processors.detectors.ml.config import MLConfig
from spikeguard.processors.detectors.ml.detector import MLDetector, MLState
from spikeguard.processors.detectors.ml.forest import CompiledForest

__all__ = ["CompiledForest", "MLConfig", "MLDetector", "MLState"]
