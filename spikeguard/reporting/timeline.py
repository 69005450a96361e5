"""From a run's events to what a person asks: what went wrong, when, why, and what was done.

Steps are kept in training order with their epoch; a step whose number was
already trained in an earlier epoch is a re-run (the trainer rolled back).
An incident is the anomalous decisions sharing an ``incident_id``; its
evidence is the loss at onset against the rolling median of the steps before
it, and what each detector said about the onset step.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from spikeguard.forensics import attribute
from spikeguard.forensics.record import skipped_samples, summary
from spikeguard.reporting.goodput import Goodput, goodput
from spikeguard.reporting.load import RunRecord
from spikeguard.schemas import Ack, StepEvent, Urgency

_RANK = {u.value: i for i, u in enumerate(Urgency)}
BASELINE_STEPS = 20


@dataclass
class StepPoint:
    step: int
    epoch: int
    loss: float
    grad_norm: float | None
    time: float
    rerun: bool  # this step number was trained before, in an earlier epoch
    lr: float | None = None  # the LR the step's update used: the schedule times the Guard's factor


@dataclass
class Incident:
    incident_id: str
    onset_step: int
    epoch: int
    type: str
    urgency: str
    first_step: int
    last_step: int
    decisions: int
    time: float | None  # wall clock of the onset step
    loss: float | None
    baseline: float | None  # rolling median of the BASELINE_STEPS finite losses before onset
    detectors: dict[str, dict] = field(default_factory=dict)  # name -> verdict summary
    rules: list[str] = field(default_factory=list)
    critical: bool = False
    layers: list[dict] = field(
        default_factory=list
    )  # forensics.layers.LayerMove, first mover first
    samples: dict | None = None  # forensics.record.summary: the incident's record, if one was given


@dataclass
class ActionRow:
    action_id: str
    kind: str
    apply_at_step: int
    params: dict
    reason: str
    incident_id: str | None
    ack_status: str  # applied, rejected, ..., or "no ack"
    ack_step: int | None
    ack_epoch: int | None  # the epoch the trainer was in after applying it
    ack_time: float | None
    result: str
    decision_id: str | None = None  # the actions of one decision are one plan
    # A skip window's sample ids, from the incident's record (report --incidents DIR): which data
    # the run no longer trains on. None: no record given or found.
    skipped_samples: list | None = None


@dataclass
class Timeline:
    run_id: str
    steps: list[StepPoint]
    anomalies: list[tuple[int, int, str]]  # (step, epoch, type) of every anomalous decision
    incidents: list[Incident]
    actions: list[ActionRow]
    rollbacks: list[tuple[int, int, int]]  # (from step, to step, new epoch)
    checkpoints: int
    # Steps the Guard re-ran (verify_reruns): (step, epoch, "transient" | "reproducible").
    reruns: list[tuple[int, int, str]] = field(default_factory=list)
    # Data skip windows applied: (step, epoch, steps' worth of data skipped).
    data_skips: list[tuple[int, int, int]] = field(default_factory=list)
    goodput: Goodput | None = None

    @property
    def epochs(self) -> list[int]:
        return sorted({p.epoch for p in self.steps})


def _baseline(points: list[StepPoint], index: int) -> float | None:
    before = [
        p.loss for p in points[max(0, index - 4 * BASELINE_STEPS) : index] if math.isfinite(p.loss)
    ][-BASELINE_STEPS:]
    return statistics.median(before) if before else None


def _history(run: RunRecord, epoch: int) -> list[StepEvent]:
    """Rank 0's steps as training saw them up to ``epoch``: a step re-run later replaces the earlier try."""
    latest: dict[int, StepEvent] = {}
    for event in run.steps:
        if event.rank == 0 and event.epoch <= epoch:
            found = latest.get(event.step)
            if found is None or event.epoch >= found.epoch:
                latest[event.step] = event
    return [latest[s] for s in sorted(latest)]


def build_timeline(run: RunRecord, incidents_dir: str | None = None) -> Timeline:
    """``incidents_dir``: where the Guard's incident records are (and ``spikeguard inspect``'s output)."""
    points: list[StepPoint] = []
    index_of: dict[tuple[int, int], int] = {}
    trained: dict[int, int] = {}  # step -> first epoch it was trained in
    for event in run.steps:
        key = (event.epoch, event.step)
        if key in index_of or event.rank != 0:
            continue  # a re-delivered record, or another rank's copy
        first = trained.setdefault(event.step, event.epoch)
        index_of[key] = len(points)
        points.append(
            StepPoint(
                event.step,
                event.epoch,
                event.loss,
                event.grad_norm,
                event.time,
                rerun=first < event.epoch,
                lr=event.lr,
            )
        )
    verdicts: dict[tuple[int, int], dict[str, dict]] = {}
    for v in run.verdicts:
        verdicts.setdefault((v.epoch, v.step), {})[v.detector] = {
            "anomaly": v.is_anomaly,
            "type": v.type.value,
            "confidence": round(v.confidence, 3),
            "rules": list(v.rules),
            "message": v.message,
        }
    anomalies: list[tuple[int, int, str]] = []
    incidents: dict[str, Incident] = {}
    seen_decisions: set[str] = set()
    for d in run.decisions:
        if not d.is_anomaly or d.decision_id in seen_decisions:
            continue
        seen_decisions.add(d.decision_id)
        anomalies.append((d.step, d.epoch, d.type.value))
        incident_id = d.incident_id or d.decision_id
        found = incidents.get(incident_id)
        if found is None:
            onset = d.incident_onset_step if d.incident_onset_step is not None else d.step
            at = index_of.get((d.epoch, onset))
            point = points[at] if at is not None else None
            found = incidents[incident_id] = Incident(
                incident_id,
                onset,
                d.epoch,
                d.type.value,
                d.urgency.value,
                d.step,
                d.step,
                0,
                time=point.time if point else None,
                loss=point.loss if point else None,
                baseline=_baseline(points, at) if at is not None else None,
                detectors=verdicts.get((d.epoch, onset)) or verdicts.get((d.epoch, d.step), {}),
                rules=list(d.rules),
                critical=d.critical,
            )
        found.decisions += 1
        found.first_step, found.last_step = (
            min(found.first_step, d.step),
            max(found.last_step, d.step),
        )
        if _RANK[d.urgency.value] > _RANK[found.urgency]:
            found.urgency = d.urgency.value
        for rule in d.rules:
            if rule not in found.rules:
                found.rules.append(rule)
    acks: dict[str, Ack] = {}
    for answer in run.acks:
        acks.setdefault(answer.action_id, answer)  # the first answer (later ones are duplicates)
    epoch_at = sorted((p.time, p.epoch) for p in points)
    rows: list[ActionRow] = []
    rollbacks: list[tuple[int, int, int]] = []
    seen_actions: set[str] = set()
    for a in run.actions:
        if a.action_id in seen_actions:
            continue
        seen_actions.add(a.action_id)
        ack = acks.get(a.action_id)
        ack_epoch = None
        if ack is not None:
            later = [e for t, e in epoch_at if t >= ack.time]
            ack_epoch = later[0] if later else (epoch_at[-1][1] if epoch_at else None)
        rows.append(
            ActionRow(
                a.action_id,
                a.kind.value,
                a.apply_at_step,
                dict(a.params),
                a.reason,
                a.incident_id,
                ack.status.value if ack else "no ack",
                ack.step if ack else None,
                ack_epoch,
                ack.time if ack else None,
                ack.result if ack else "",
                a.decision_id,
            )
        )
        if a.kind.value == "rollback" and ack is not None and ack.status.value == "applied":
            target = a.params.get("target_step")
            if isinstance(target, (int, float)):
                rollbacks.append((ack.step, int(target), ack_epoch if ack_epoch is not None else 0))
    # A skip planned with a rollback is applied on the rewound step; it happened where the
    # rollback left, and is drawn there.
    rolled_back_at = {
        r.decision_id: r.ack_step
        for r in rows
        if r.kind == "rollback"
        and r.ack_status == "applied"
        and r.decision_id
        and r.ack_step is not None
    }
    data_skips = [
        (
            rolled_back_at.get(r.decision_id or "", r.ack_step),
            r.ack_epoch or 0,
            _skipped_steps(r.params),
        )
        for r in rows
        if r.kind == "skip_batches" and r.ack_status == "applied" and r.ack_step is not None
    ]
    if incidents_dir is not None:
        for row in rows:
            if row.kind == "skip_batches" and row.incident_id:
                row.skipped_samples = skipped_samples(incidents_dir, row.incident_id, row.params)
    histories: dict[int, list[StepEvent]] = {}  # one per epoch, however many incidents it has
    for incident in incidents.values():
        history = histories.get(incident.epoch)
        if history is None:
            history = histories[incident.epoch] = _history(run, incident.epoch)
        incident.layers = [m.as_dict() for m in attribute(history, incident.onset_step)]
        if incidents_dir is not None:
            incident.samples = summary(incidents_dir, run.run_id, incident.incident_id)
    return Timeline(
        run.run_id,
        points,
        anomalies,
        sorted(incidents.values(), key=lambda i: (i.epoch, i.onset_step)),
        rows,
        rollbacks,
        # One per save, as the Guard counts them: a checkpoint is announced again when it is
        # demoted (healthy=False) and when it is rotated out (deleted).
        checkpoints=len({c.checkpoint_id for c in run.checkpoints if not c.deleted}),
        reruns=sorted({(e.step, e.epoch, e.rerun) for e in run.steps if e.rerun is not None}),
        data_skips=data_skips,
        goodput=goodput(run),
    )


def _skipped_steps(params: dict) -> int:
    """Steps' worth of data a SKIP_BATCHES action drops: its window plus its extra."""
    try:
        return max(int(params["to_step"]) - int(params["from_step"]) + 1, 0) + int(
            params.get("extra", 0)
        )
    except (KeyError, TypeError, ValueError):
        return 0
