"""Fusion's settings: which detectors a step waits for, how their verdicts weigh, how long to wait.

Apart from the fusion itself (fusion.py) because the settings, the runs
topic's overrides (producers/run_plan.py) and the Guard's plan read them
without the engine.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from spikeguard.processors.decision_table import DEFAULT_PRECEDENCE


class FusionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    expected: list[str] = Field(
        default_factory=lambda: ["statistical", "rules", "ml", "predictor"],
        description="detectors whose verdicts a step waits for",
    )
    weights: dict[str, float] = Field(
        default_factory=lambda: {"rules": 1.0, "statistical": 1.0, "ml": 0.5},
        description="reliability of each detector's anomaly verdicts in [0, 1] (noisy-OR weights)",
    )
    default_weight: float = Field(
        0.5, ge=0.0, le=1.0, description="weight of a detector not in weights"
    )
    threshold: float = Field(
        0.55, gt=0.0, le=1.0, description="fused score at which a step is anomalous"
    )
    precedence: list[str] = Field(
        default_factory=lambda: list(DEFAULT_PRECEDENCE),
        description="whose anomaly type wins when several detectors flag a step",
    )
    preventive_detectors: list[str] = Field(
        default_factory=lambda: ["predictor"],
        description="detectors whose warnings are preventive only (never an anomaly)",
    )
    warning_confidence: float = Field(
        0.5, ge=0.0, le=1.0, description="a preventive warning needs at least this confidence"
    )
    low_confidence: float = Field(
        0.7,
        ge=0.0,
        le=1.0,
        description="below this fused confidence the urgency is one level lower",
    )
    deadline_seconds: float = Field(
        5.0,
        gt=0.0,
        description="a detector whose watermark for a run has not moved for this long (wall "
        "clock) is not waited for until it moves again",
    )
    recovery_seconds: float = Field(
        60.0,
        gt=0.0,
        description="after an outage (a stretch in which no verdict reached fusion), a detector "
        "that was alive when it began is waited for this long (flow clock) from its end before "
        "fusion decides without it: time to rejoin its group and replay from its snapshot (it "
        "only ever lengthens deadline_seconds)",
    )
    deadline_steps: int | None = Field(
        None,
        ge=0,
        description="if set, a step also waits only while the run's newest step is less than "
        "this far ahead (timing-dependent after an outage: off by default)",
    )
    max_pending: int = Field(
        1024, ge=1, description="at most this many undecided steps per run (the oldest go first)"
    )
    incident_gap_steps: int = Field(20, ge=1, description="healthy steps that close an incident")
    baseline_window_steps: int = Field(
        32,
        ge=1,
        le=4096,
        description="recent healthy steps whose median is the evidence's baseline",
    )
