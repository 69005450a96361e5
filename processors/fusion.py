"""Fusion: the verdicts of one (run, epoch, step) become exactly one decision.

A step is decided when every expected detector has spoken for it, or has
judged the run past it: a detector judges a run's steps in order (one
partition), so its newest verdict is its *watermark* for the run. A decision
then depends on the data, not on how fast each worker happened to be: after an
outage, a fast detector racing ahead does not get steps decided without the
slow ones. Fusion stops waiting for a detector only when its watermark has not
moved for ``deadline_seconds`` of wall-clock time (it is down, or not deployed),
or when the pending set is full (``max_pending``); ``deadline_steps``, off by
default, adds the old "this far behind the newest step" rule. The decision lists
the detectors that were ``missing``. Decisions leave in step order. A verdict
for a step already decided is dropped and counted (``late_verdicts``), so a
late verdict never produces a second, contradictory decision; a repeated
verdict (at-least-once delivery) is ignored (``duplicate_verdicts``).

After an outage (:meth:`Fusion.resume`: no verdict reached fusion for at least
``deadline_seconds``, or fusion came back from a snapshot) every detector's
consumer reconnects, rejoins its group and replays from its snapshot, and under
load one comes back seconds after the others; while the others' verdicts flow,
the deadline would give up on it and decide the steps it has not judged yet
without it (a spike decided ``divergence``, not the rules' critical
``extreme_loss``: no rollback). So a detector whose watermark moved less than
``deadline_seconds`` before the outage (it was alive) is *recovering*: it is
waited for until ``recovery_seconds`` after the outage ended, even if it moved
in between (a consumer may fetch a little, then have its commit refused,
rejoin and replay from its snapshot: verdicts that do not move its watermark),
and only then given up on (it died in the outage). One that was already
stalled when the outage began gets no such grace. The grace only ever
lengthens a wait; memory stays bounded by ``max_pending``.

Scoring is a weighted noisy-OR of the anomalous verdicts, ``1 - prod(1 - w c)``:
one sure detector is enough, agreeing detectors reinforce each other, and a
silent or healthy detector does not dilute the others (a weighted average
would: with weights 0.3/0.4/0.3 and threshold 0.6 a NaN flagged by rules alone
scores 0.3 and passes). A *critical* verdict (non-finite values, extreme loss,
gradient explosion; :func:`~.decision_table.is_critical` is the one rule)
decides alone: its step does not wait for the other detectors' verdicts, only
for the steps before it to be decided (by the same watermark rule), and the
decision says ``critical``.

The predictor's warnings never make an anomaly: alone they give a
``preventive`` decision of low urgency. Consecutive anomalous steps form an
incident until the run has been healthy for ``incident_gap_steps`` steps; a
rollback (a new epoch) closes it. This is the only place incidents are
grouped: the recovery policy takes ``incident_id`` as it comes.

Every decision carries its evidence when the verdicts carry the step's values:
the loss and gradient norm, next to their medians over the run's recent
healthy steps (learnt only from steps decided healthy, so a spike never
becomes its own baseline).
"""

from __future__ import annotations

import math
from heapq import heapify, heappop, heappush
from typing import Any, Iterable

from spikeguard.processors.decision_table import (
    FULL_WEIGHT_TYPES,
    WARNING_TYPES,
    is_critical,
    urgency,
)
from spikeguard.processors.fusion_config import FusionConfig
from spikeguard.processors.robust_stats import RollingMedian
from spikeguard.schemas import AnomalyType, Decision, Urgency, Verdict
from spikeguard.schemas.ids import decision_id, incident_id


class _Pending:
    __slots__ = ("verdicts", "flagged", "critical")

    def __init__(self) -> None:
        self.verdicts: dict[str, Verdict] = {}
        self.flagged = False  # some verdict says anomaly (or warning)
        self.critical = False  # some verdict is critical: no need to wait for the others


#: Marks an :meth:`Fusion.undo_state`: the same process's state a moment ago, its times as they were.
UNDO_POINT = "undo_point"

# Decision(**fields) minus BaseModel.__init__'s Python frame: the same
# validation (a documented pydantic attribute), ~0.5 us less per decision.
_validate_decision = Decision.__pydantic_validator__.validate_python


class Fusion:
    def __init__(self, config: FusionConfig | None = None, *, run_id: str) -> None:
        self.config = config or FusionConfig()
        self.run_id = run_id
        cfg = self.config
        self._expected = frozenset(cfg.expected)
        self._rank = {name: i for i, name in enumerate(cfg.precedence)}
        self._preventive = frozenset(cfg.preventive_detectors)
        # Read on every verdict: plain attributes, not pydantic look-ups. The
        # config is frozen, so these never go stale.
        self._deadline_s = cfg.deadline_seconds
        self._recovery_s = cfg.recovery_seconds
        self._deadline_steps = cfg.deadline_steps
        self._max_pending = cfg.max_pending
        self._gap = cfg.incident_gap_steps
        # Baselines span epochs: a rollback does not change what normal looks like.
        self._loss_baseline = RollingMedian(cfg.baseline_window_steps)
        self._grad_baseline = RollingMedian(cfg.baseline_window_steps)
        self.late_verdicts = 0
        self.stale_verdicts = 0  # from an epoch older than the newest seen
        self.duplicate_verdicts = 0
        self._reset_epoch(0)

    def _reset_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._pending: dict[int, _Pending] = {}
        self._heap: list[int] = []
        self._decided = -1  # last decided step of this epoch
        self._newest = -1
        self._onset: int | None = None  # open incident's first step
        self._last_anomaly = -1
        self._checked_at: float | None = None
        # detector -> (newest step it judged in this epoch, wall-clock time that last moved)
        self._marks: dict[str, tuple[int, float]] = {}
        self._epoch_seen_at: float | None = None  # a silent detector's stall clock starts here
        # detector -> until when it is waited for, back from an outage (resume)
        self._recovering: dict[str, float] = {}

    @property
    def progress(self) -> tuple[int, int]:
        """(epoch, last decided step of that epoch; -1 before the first)."""
        return self._epoch, self._decided

    # -- input ---------------------------------------------------------------
    def add(self, verdict: Verdict, now: float) -> list[Decision]:
        out: list[Decision] = []
        self._add(verdict, now, out)
        return out

    def add_many(self, verdicts: Iterable[Verdict], now: float) -> list[Decision]:
        """The same as :meth:`add` for each verdict in turn, all decisions in one list.

        A batch usually holds each step's verdicts together, one per expected detector:
        such a group is decided at once (:meth:`_whole`), as :meth:`add` would decide
        it at its last verdict, without the pending-set round trips."""
        out: list[Decision] = []
        add, whole = self._add, self._whole
        verdicts = verdicts if isinstance(verdicts, list) else list(verdicts)
        size, i, n = len(self._expected), 0, len(verdicts)
        while i < n:
            if not self._heap and size and whole(verdicts[i : i + size], now, out):
                i += size
                continue
            add(verdicts[i], now, out)
            i += 1
        return out

    def _whole(self, group: list[Verdict], now: float, out: list[Decision]) -> bool:
        """Decide ``group`` now if it is one new step's verdicts, one per expected detector,
        which :meth:`add` would decide at the last of them and not before; else False, unchanged.

        Not before: none is critical, no expected detector has judged past the step or
        stalled (watermarks only get fresher within the group), and the step-count
        rules cannot fire for a lone pending step."""
        step, epoch = group[0].step, self._epoch
        if len(group) != len(self._expected) or step <= self._newest:  # (_decided <= _newest)
            return False
        names = set()
        for v in group:
            if v.step != step or v.epoch != epoch or (v.is_anomaly and is_critical(v)):
                return False
            names.add(v.detector)
        if (
            names != self._expected
            or self._deadline_steps is not None
            and self._deadline_steps <= 0
        ):
            return False  # (max_pending >= 1: a lone pending step never overflows it)
        marks = self._marks
        seen_at = now if self._epoch_seen_at is None else self._epoch_seen_at
        for name in names:  # (no watermark is past the step: none is past _newest)
            mark = marks.get(name)
            if now - (seen_at if mark is None else mark[1]) >= self._deadline_s:
                return False
        self._epoch_seen_at = seen_at
        pending = self._pending[step] = _Pending()
        for v in group:
            marks[v.detector] = (step, now)
            pending.verdicts[v.detector] = v
            if v.is_anomaly:
                pending.flagged = True
        self._newest = step
        out.append(self._decide(step))
        self._checked_at = now
        return True

    def _add(self, verdict: Verdict, now: float, out: list[Decision]) -> None:
        if verdict.epoch != self._epoch:
            if verdict.epoch < self._epoch:
                self.stale_verdicts += 1
                return
            out += self.flush()  # the old epoch's steps are decided with what they have
            self._reset_epoch(verdict.epoch)
        step = verdict.step
        if self._epoch_seen_at is None:
            self._epoch_seen_at = now
        mark = self._marks.get(verdict.detector)
        moved = mark is None or step > mark[0]
        if moved:  # even a late or repeated verdict shows how far its detector got
            self._marks[verdict.detector] = (step, now)
        if step <= self._decided:
            self.late_verdicts += 1
            return
        pending = self._pending.get(step)
        changed = pending is None or moved  # the pending set grows, or a watermark moved
        if pending is None:
            pending = self._pending[step] = _Pending()
            heappush(self._heap, step)
        verdicts = pending.verdicts
        if verdict.detector in verdicts:
            self.duplicate_verdicts += 1
            return
        verdicts[verdict.detector] = verdict
        if step > self._newest:
            self._newest = step
        if verdict.is_anomaly:
            pending.flagged = True
            if is_critical(verdict):  # decides alone, once the steps before it are decided
                pending.critical = True
                changed = True
        # A verdict for a known step behind the oldest one, at the time of the
        # last check: nothing that makes the oldest step due has changed.
        if not changed and now == self._checked_at and step != self._heap[0]:
            return
        self._release(now, out)

    def resume(self, now: float, quiet_s: float) -> None:
        """No verdict arrived for ``quiet_s`` until ``now``: if that is an outage (as long as the
        deadline at least; a slow trainer's pauses are not), the detectors alive when it began
        are recovering (module doc). Only ever lengthens a wait, so nothing becomes due here."""
        if quiet_s < self._deadline_s:
            return
        until = now + self._recovery_s
        for name, (_, moved_at) in self._marks.items():
            if now - moved_at < self._deadline_s:
                self._recovering[name] = until

    def tick(self, now: float) -> list[Decision]:
        """Decide the steps that were waiting only for detectors that have stalled since."""
        out: list[Decision] = []
        self._release(now, out)
        return out

    def flush(self) -> list[Decision]:
        """End of input: decide every pending step now."""
        out = []
        while self._heap:
            out.append(self._decide(heappop(self._heap)))
        return out

    def _release(self, now: float, out: list[Decision]) -> None:
        heap, pending, expected = self._heap, self._pending, self._expected
        newest = self._newest
        while heap:
            step = heap[0]
            p = pending[step]
            if not (
                p.critical
                or expected.issubset(p.verdicts)
                or self._nobody_to_wait_for(step, p, now)
                or (self._deadline_steps is not None and newest - step >= self._deadline_steps)
                or len(heap) > self._max_pending
            ):
                break
            heappop(heap)
            out.append(self._decide(step))
        self._checked_at = now  # the oldest pending step (if any) is not due at this time

    def _nobody_to_wait_for(self, step: int, p: _Pending, now: float) -> bool:
        """Every expected detector has spoken for ``step``, judged past it, or stalled."""
        marks, verdicts, silent_since = self._marks, p.verdicts, self._epoch_seen_at
        recovering = self._recovering
        for name in self._expected:
            if name in verdicts:
                continue
            mark = marks.get(name)
            if mark is not None and mark[0] >= step:
                continue  # it judged this run past the step: no verdict will come for it
            last_moved = silent_since if mark is None else mark[1]
            if (
                last_moved is not None
                and now - last_moved >= self._deadline_s
                and now >= recovering.get(name, now)
            ):
                continue  # stalled, not recovering: decide without it (listed as missing)
            return False
        return True

    # -- judgement -----------------------------------------------------------
    def _decide(self, step: int) -> Decision:
        pending = self._pending.pop(step)
        self._decided = step
        verdicts = pending.verdicts
        evidence = self._evidence(step, verdicts)
        if pending.flagged:
            decision = self._judge(step, verdicts, evidence)
        else:
            # Nobody flagged it (nearly every step): the short way to what _judge says,
            # since the threshold is > 0 and a step nobody flags scores 0.
            if self._onset is not None and step - self._last_anomaly > self._gap:
                self._onset = None
            decision = _validate_decision(
                {
                    "decision_id": decision_id(self.run_id, step, self._epoch),
                    "run_id": self.run_id,
                    "step": step,
                    "epoch": self._epoch,
                    "session": _session_of(verdicts),
                    "detectors": {name: v.confidence for name, v in verdicts.items()},
                    "missing": [name for name in self.config.expected if name not in verdicts],
                    "is_anomaly": False,
                    "confidence": 0.0,
                    "evidence": evidence,
                }
            )
        if evidence is not None and not decision.is_anomaly:
            self._learn_baseline(evidence)
        return decision

    def _evidence(self, step: int, verdicts: dict[str, Verdict]) -> dict[str, Any] | None:
        """The step's values (from any verdict that carries them) and the run's baselines."""
        for v in verdicts.values():
            if v.loss is not None:
                loss, grad = v.loss, v.grad_norm
                break
        else:
            return None
        lb, gb = self._loss_baseline.get(), self._grad_baseline.get()
        return {
            "step": step,
            "epoch": self._epoch,
            "loss": loss,
            "grad_norm": grad,
            "loss_baseline": None if lb != lb else lb,  # NaN: no healthy step yet
            "grad_norm_baseline": None if gb != gb else gb,
        }

    def _learn_baseline(self, evidence: dict[str, Any]) -> None:
        loss, grad = evidence["loss"], evidence["grad_norm"]
        if math.isfinite(loss):
            self._loss_baseline.update(loss)
        if grad is not None and math.isfinite(grad):
            self._grad_baseline.update(grad)

    def _judge(
        self, step: int, verdicts: dict[str, Verdict], evidence: dict[str, Any] | None
    ) -> Decision:
        cfg = self.config
        anomalous, warnings = [], []
        miss = 1.0
        for name, v in verdicts.items():
            if not v.is_anomaly:
                continue
            if name in self._preventive or v.type in WARNING_TYPES:
                if v.confidence >= cfg.warning_confidence:
                    warnings.append(v)
                continue
            anomalous.append(v)
            weight = cfg.weights.get(name, cfg.default_weight)
            if v.type in FULL_WEIGHT_TYPES:  # a finding only its detector can make
                weight = 1.0
            miss *= 1.0 - weight * v.confidence
        score = 1.0 - miss
        critical = [v for v in anomalous if is_critical(v)]
        common: dict[str, Any] = dict(
            decision_id=decision_id(self.run_id, step, self._epoch),
            run_id=self.run_id,
            step=step,
            epoch=self._epoch,
            session=_session_of(verdicts),
            detectors={name: v.confidence for name, v in verdicts.items()},
            flagged_by={name: v.type for name, v in verdicts.items() if v.is_anomaly},
            missing=[name for name in cfg.expected if name not in verdicts],
            evidence=evidence,
        )
        if critical or score >= cfg.threshold:
            top = min(critical or anomalous, key=self._priority)
            confidence = max(score, top.confidence) if critical else score
            if self._onset is None or step - self._last_anomaly > cfg.incident_gap_steps:
                self._onset = step
            self._last_anomaly = step
            rules: list[str] = []
            for v in sorted(anomalous, key=self._priority):
                rules.extend(r for r in v.rules if r not in rules)
            return Decision(
                **common,
                is_anomaly=True,
                type=top.type,
                confidence=min(1.0, confidence),
                critical=bool(critical),
                urgency=urgency(top.type, confidence, bool(critical), cfg.low_confidence),
                incident_id=incident_id(self.run_id, self._onset, self._epoch),
                incident_onset_step=self._onset,
                rules=rules,
                signals={**top.signals, "score": round(score, 4), "by": top.detector},
            )
        if self._onset is not None and step - self._last_anomaly > cfg.incident_gap_steps:
            self._onset = None
        if warnings:
            top = max(warnings, key=lambda v: v.confidence)
            kind = top.type if top.type in WARNING_TYPES else AnomalyType.INSTABILITY_WARNING
            return Decision(
                **common,
                is_anomaly=False,
                preventive=True,
                type=kind,
                confidence=top.confidence,
                urgency=Urgency.LOW,
                rules=list(top.rules),
                signals={**top.signals, "by": top.detector},
            )
        return Decision(**common, is_anomaly=False, confidence=score)

    def _priority(self, v: Verdict) -> tuple[int, int, float]:
        return (not is_critical(v), self._rank.get(v.detector, len(self._rank)), -v.confidence)

    # -- state ---------------------------------------------------------------
    def state_dict(self, *, keep_verdicts: bool = False) -> dict[str, Any]:
        dump = list if keep_verdicts else lambda vs: [v.model_dump(mode="json") for v in vs]
        return {
            "epoch": self._epoch,
            "decided": self._decided,
            "newest": self._newest,
            "onset": self._onset,
            "last_anomaly": self._last_anomaly,
            "late_verdicts": self.late_verdicts,
            "stale_verdicts": self.stale_verdicts,
            "duplicate_verdicts": self.duplicate_verdicts,
            "loss_baseline": self._loss_baseline.state_dict(),
            "grad_norm_baseline": self._grad_baseline.state_dict(),
            "marks": {name: list(mark) for name, mark in self._marks.items()},
            "epoch_seen_at": self._epoch_seen_at,
            "recovering": dict(self._recovering),
            "pending": [
                {"step": s, "verdicts": dump(p.verdicts.values())}
                for s, p in sorted(self._pending.items())
            ],
        }

    def undo_state(
        self,
    ) -> dict[str, Any]:  # Stage.undo_point, per batch: frozen verdicts need no dump
        return {**self.state_dict(keep_verdicts=True), UNDO_POINT: True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reset_epoch(int(state["epoch"]))
        self._decided = int(state["decided"])
        self._newest = int(state["newest"])
        self._onset = None if state["onset"] is None else int(state["onset"])
        self._last_anomaly = int(state["last_anomaly"])
        self.late_verdicts = int(state["late_verdicts"])
        self.stale_verdicts = int(state["stale_verdicts"])
        self.duplicate_verdicts = int(state["duplicate_verdicts"])
        if "loss_baseline" in state:  # absent in a snapshot from before evidence existed
            self._loss_baseline.load_state_dict(state["loss_baseline"])
            self._grad_baseline.load_state_dict(state["grad_norm_baseline"])
        # Absent in a snapshot from before watermarks: they rebuild from the next verdicts.
        self._marks = {name: (int(m[0]), float(m[1])) for name, m in state.get("marks", {}).items()}
        self._epoch_seen_at = state.get("epoch_seen_at")
        self._recovering = {name: float(t) for name, t in state.get("recovering", {}).items()}
        for item in state["pending"]:
            p = self._pending[int(item["step"])] = _Pending()
            for raw in item["verdicts"]:
                v = raw if type(raw) is Verdict else Verdict.model_validate(raw)  # (undo_state)
                p.verdicts[v.detector] = v
                p.flagged = p.flagged or v.is_anomaly
                p.critical = p.critical or (v.is_anomaly and is_critical(v))
            self._heap.append(int(item["step"]))
        heapify(self._heap)


def _session_of(verdicts: dict[str, Verdict]) -> str | None:
    """The trainer session of the decided step (its verdicts carry it): its actions answer that one."""
    for verdict in verdicts.values():
        return verdict.session
    return None
