"""The detectors by name, and their config models.

``DETECTORS[name](CONFIGS[name]())`` builds one; each judges one run. The
``ml`` and ``predictor`` modules are written separately: while one of them is not
there yet (no module file, or the module lacks its two classes), it is left
out of ``DETECTORS`` (and listed in ``MISSING``, with a warning) and an empty
placeholder stands in ``CONFIGS`` so settings still load. An error raised
while importing a module propagates: a broken detector must not vanish.
"""

from __future__ import annotations

import importlib
import warnings

from pydantic import BaseModel, ConfigDict

from spikeguard.processors.detectors.base import Detector
from spikeguard.processors.detectors.rules import RulesConfig, RulesDetector
from spikeguard.processors.detectors.statistical import StatisticalConfig, StatisticalDetector

DETECTORS: dict[str, type[Detector]] = {
    "statistical": StatisticalDetector,
    "rules": RulesDetector,
}
CONFIGS: dict[str, type[BaseModel]] = {
    "statistical": StatisticalConfig,
    "rules": RulesConfig,
}
MISSING: list[str] = []  # detectors whose module is not there (yet)


class _PlaceholderConfig(BaseModel):
    """Stands in for the config of a detector whose module is absent."""

    model_config = ConfigDict(extra="forbid", frozen=True)


for _name, _module, _detector, _config in (
    ("ml", "ml", "MLDetector", "MLConfig"),
    ("predictor", "predictor", "PredictorDetector", "PredictorConfig"),
):
    _path = f"{__name__}.{_module}"
    try:
        _mod = importlib.import_module(_path)
    except ModuleNotFoundError as exc:
        if exc.name != _path:
            raise
        MISSING.append(_name)
        CONFIGS[_name] = _PlaceholderConfig
        continue
    if not (hasattr(_mod, _detector) and hasattr(_mod, _config)):  # a module still being written
        warnings.warn(f"{_path} lacks {_detector} or {_config}; {_name!r} is not registered", stacklevel=1)
        MISSING.append(_name)
        CONFIGS[_name] = _PlaceholderConfig
        continue
    DETECTORS[_name] = getattr(_mod, _detector)
    CONFIGS[_name] = getattr(_mod, _config)

__all__ = ["CONFIGS", "DETECTORS", "MISSING", "Detector"]
