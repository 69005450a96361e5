"""The ``ml`` detector's settings (see :mod:`.detector` for what they tune)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from spikeguard.processors.detectors.ml.layers import LayerConfig
from spikeguard.processors.features import FeatureConfig


class MLConfig(BaseModel):
    """Defaults: 50 trees x 256 rows and a refit every 3000 healthy steps keep it above
    20k steps/s; the threshold flags ~0.5 % of the (heavy-tailed) real NanoGPT steps,
    nearly all of them real upward jumps, and ~0.1 % of simulated healthy steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    forest: bool = Field(
        False,
        description="score steps with the isolation forest: off by default (on the synthetic "
        "suite and the real curves it added no detection the statistical and rules detectors "
        "miss, and it cost the most CPU; docs/detection.md); the layer-share model stays on",
    )
    features: FeatureConfig = Field(default_factory=FeatureConfig, description="rolling features")
    layers: LayerConfig = Field(
        default_factory=LayerConfig, description="layer-share model (steps with per-layer norms)"
    )
    warmup_steps: int = Field(
        200, ge=16, description="healthy rows before the first fit, and between early refits"
    )
    buffer_size: int = Field(1024, ge=16, description="newest healthy rows the forest is fitted on")
    refit_every: int = Field(
        3000,
        ge=16,
        description="healthy rows between refits once the buffer is full: a fit and "
        "its calibration cost ~12 ms, ~4 us a step at 3000, and the features follow the run between",
    )
    n_estimators: int = Field(50, ge=1, le=1000, description="trees in the forest")
    max_samples: int = Field(256, ge=2, description="rows drawn per tree (depth limit log2 of it)")
    random_state: int = Field(0, ge=0, description="seed; fit number n uses random_state + n - 1")
    threshold_quantile: float = Field(
        0.995, gt=0.5, lt=1.0, description="quantile of the training scores the threshold starts at"
    )
    threshold_margin: float = Field(
        0.75, ge=0.0, lt=1.0, description="fraction of the way from there to the score ceiling"
    )
    healthy_gate_z: float = Field(
        6.0, gt=0.0, description="a row may train the forest when no residual exceeds this (s.d.)"
    )
    downside_clip: float = Field(
        1.0, ge=0.0, description="features are clamped at minus this: only the upward side is news"
    )
    nonfinite_confidence: float = Field(
        0.95, ge=0.0, le=1.0, description="confidence of the verdict on a NaN/Inf step"
    )
    release_idle_s: float = Field(
        300.0,
        gt=0.0,
        description="in a worker, a run with no step for this long gives back its "
        "forest (~35 kB); its next step refits it from the same rows and seed: same verdicts",
    )
