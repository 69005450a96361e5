"""Metrics from what the pipeline decides: verdicts, decisions, actions, per run and in all."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from spikeguard.schemas import Action, HealthLevel
from spikeguard.schemas.actions import SkipBatchesParams

#: Health levels as numbers, so that a gauge can carry them (0 best, 4 critical).
HEALTH_LEVELS = {level: i for i, level in enumerate(HealthLevel)}


class JudgingMetrics:
    """What detectors, fusion and the actuator produced, counted from their outputs."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.verdicts = Counter(
            "spikeguard_verdicts_total",
            "Verdicts by detector and outcome.",
            ["detector", "anomaly"],
            registry=r,
        )
        self.decisions = Counter(
            "spikeguard_decisions_total",
            "Anomalous or preventive decisions by type and urgency.",
            ["type", "urgency"],
            registry=r,
        )
        self.actions = Counter(
            "spikeguard_actions_total", "Actions issued, by kind.", ["kind"], registry=r
        )
        self.run_health = Gauge(
            "spikeguard_run_instability_probability",
            "The predictor's latest probability of instability within its horizon.",
            ["run_id"],
            registry=r,
        )
        self.run_health_level = Gauge(
            "spikeguard_run_health_level",
            "The predictor's latest health level of a run: 0 excellent, 1 good, 2 warning, "
            "3 concerning, 4 critical.",
            ["run_id"],
            registry=r,
        )
        self.run_anomalous_verdicts = Counter(
            "spikeguard_run_anomalous_verdicts_total",
            "A run's anomalous verdicts, by detector (which detectors fired, per run).",
            ["run_id", "detector"],
            registry=r,
        )
        self.run_decisions = Counter(
            "spikeguard_run_decisions_total",
            "A run's anomalous or preventive decisions, by urgency.",
            ["run_id", "urgency"],
            registry=r,
        )
        self.run_last_decision_time = Gauge(
            "spikeguard_run_last_decision_timestamp_seconds",
            "When (unix seconds) a run last had an anomalous or preventive decision of this "
            "urgency; alerts compare it with time(), which a counter's first sample defeats.",
            ["run_id", "urgency"],
            registry=r,
        )
        self.run_actions = Counter(
            "spikeguard_run_actions_total",
            "Actions issued for a run, by kind.",
            ["run_id", "kind"],
            registry=r,
        )
        self.run_last_actions_time = Gauge(
            "spikeguard_run_last_actions_timestamp_seconds",
            "When (unix seconds) a run last got this plan of actions: the kinds one decision "
            "caused, in the order issued and joined by '+' (rollback+skip_batches+scale_lr). "
            "One series per plan, so a dashboard draws one mark per plan, at its time.",
            ["run_id", "kinds"],
            registry=r,
        )
        self.run_batches_skipped = Counter(
            "spikeguard_run_batches_skipped_total",
            "Batches the policy asked a run to skip (SKIP_BATCHES: the rewound window plus the "
            "extra): data not trained on.",
            ["run_id"],
            registry=r,
        )

    def health_gauges(self) -> tuple[Gauge, ...]:
        """The predictor's latest word on a run: one series per run, removed when it ends."""
        return (self.run_health, self.run_health_level)


def skipped_batches(action: Action) -> int:
    """Batches a SKIP_BATCHES action skips (0 for any other kind)."""
    p = action.params
    if not isinstance(p, SkipBatchesParams):  # an Action's params always match its kind
        return 0
    return max(0, p.to_step - p.from_step + 1) + p.extra
