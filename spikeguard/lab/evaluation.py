"""Scoring a detector's decisions against labelled runs, the same way for every system.

Input per run: the steps with their labels, and one :class:`Mark` per judged
step (the pipeline's decisions and the baselines' flags both reduce to it).

Definitions (steps are step numbers; ``EvaluationConfig`` holds the numbers):

- **Episode**: a maximal run of consecutive labelled steps of the same kind.
- **Alarm**: a mark with ``is_anomaly`` that is not a warning. A **warning**
  is ``preventive`` or an anomaly of type ``instability_warning``/``lr_too_high``
  (the predictor's early warnings, which never roll back). Alarms separated
  by at most ``merge_gap`` quiet steps form one **alarm episode**.
- An alarm episode is **true** when it overlaps some episode's window
  ``[start - pre_tolerance, end + post_tolerance]``, else **false**.
- An episode is **detected** when an alarm falls in its window; its **delay**
  is (first such alarm - start), and 0 for an alarm in the ``pre_tolerance``
  steps before the start (a detector that fires on the run-up is on time).
  A ``non_finite`` episode counts as detected only with an alarm AT its start.
- recall = detected / episodes; precision = true alarm episodes / alarm
  episodes; F1 their harmonic mean; false alarms per 10k clean steps = false
  alarm episodes x 10,000 / unlabelled steps (benign events and precursors are
  clean steps). Undefined values (no episodes, no alarms) are None.
- **Lead time**: for each episode, start - the earliest warning within
  ``lookback`` steps before the start. Warning episodes (merged like alarms)
  that neither overlap an episode window nor precede an episode start by at
  most ``lookback`` steps are **warnings for nothing** (per 10k clean steps).
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Sequence

from pydantic import BaseModel, ConfigDict, Field

from spikeguard.lab.runfile import StepLabel

WARNING_TYPES = frozenset({"instability_warning", "lr_too_high"})


class Mark(NamedTuple):
    """What scoring needs of one decision."""

    step: int
    is_anomaly: bool
    preventive: bool = False
    type: str = "none"


class EvaluationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    merge_gap: int = Field(
        5, ge=0, description="alarms at most this many steps apart form one episode"
    )
    pre_tolerance: int = Field(
        2, ge=0, description="steps before an episode whose alarms count (delay 0)"
    )
    post_tolerance: int = Field(
        5, ge=0, description="steps after an episode whose alarms still count"
    )
    lookback: int = Field(
        50, ge=1, description="how far before an episode a warning counts as lead"
    )


class Episode(NamedTuple):
    start: int
    end: int  # inclusive
    kind: str


class EpisodeResult(NamedTuple):
    episode: Episode
    detected: bool
    delay: int | None
    lead: int | None


@dataclass
class RunScore:
    group: str
    steps: int
    clean_steps: int
    episodes: list[EpisodeResult]
    alarm_episodes: int
    false_alarm_episodes: int
    warning_episodes: int
    false_warning_episodes: int


def marks_from_decisions(decisions: Iterable) -> list[Mark]:
    """Marks from pipeline :class:`Decision` objects (or anything with those attributes)."""
    out = []
    for d in decisions:
        kind = getattr(d.type, "value", d.type)
        out.append(Mark(d.step, bool(d.is_anomaly), bool(d.preventive), str(kind)))
    return out


def is_warning(mark: Mark) -> bool:
    return mark.preventive or (mark.is_anomaly and mark.type in WARNING_TYPES)


def is_alarm(mark: Mark) -> bool:
    """An anomalous mark that is not an early warning: what precision and false alarms count."""
    return mark.is_anomaly and not is_warning(mark)


def label_windows(episodes: Iterable[Episode], config: EvaluationConfig) -> list[tuple[int, int]]:
    """Each labelled episode's window: an alarm in it is a detection, not a false alarm."""
    return [(e.start - config.pre_tolerance, e.end + config.post_tolerance) for e in episodes]


def in_a_window(first: int, last: int, windows: Iterable[tuple[int, int]]) -> bool:
    """Whether the alarm episode ``first..last`` overlaps any labelled window."""
    return any(first <= hi and last >= lo for lo, hi in windows)


def episodes_from_labels(steps: Sequence[int], labels: Sequence[StepLabel]) -> list[Episode]:
    """Maximal runs of consecutive labelled steps of one kind."""
    episodes: list[Episode] = []
    start = None
    for i, lab in enumerate(labels):
        if lab.label and (start is None or lab.kind != labels[i - 1].kind):
            if start is not None:
                episodes.append(Episode(steps[start], steps[i - 1], labels[start].kind))
            start = i
        elif not lab.label and start is not None:
            episodes.append(Episode(steps[start], steps[i - 1], labels[start].kind))
            start = None
    if start is not None:
        episodes.append(Episode(steps[start], steps[-1], labels[start].kind))
    return episodes


def merge(steps: Iterable[int], gap: int) -> list[tuple[int, int]]:
    """Sorted steps -> (first, last) runs whose members are at most ``gap`` quiet steps apart."""
    runs: list[list[int]] = []
    for step in sorted(steps):
        if runs and step - runs[-1][1] - 1 <= gap:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return [(a, b) for a, b in runs]


def score_run(
    steps: Sequence[int],
    labels: Sequence[StepLabel] | None,
    marks: Iterable[Mark],
    config: EvaluationConfig | None = None,
    group: str = "",
) -> RunScore:
    """Score one run's marks against its labels (no labels: a clean run)."""
    cfg = config or EvaluationConfig()
    labels = labels or [StepLabel(False, "")] * len(steps)
    episodes = episodes_from_labels(steps, labels)
    marks = list(marks)
    alarm_steps = sorted(m.step for m in marks if is_alarm(m))
    warn_steps = sorted(m.step for m in marks if is_warning(m))
    alarm_set = set(alarm_steps)
    windows = label_windows(episodes, cfg)

    results = []
    for e, (lo, hi) in zip(episodes, windows):
        first = _first_in(alarm_steps, lo, hi)
        if e.kind == "non_finite":
            first = e.start if e.start in alarm_set else None
        delay = None if first is None else max(0, first - e.start)
        early = _first_in(warn_steps, e.start - cfg.lookback, e.start - 1)
        lead = None if early is None else e.start - early
        results.append(EpisodeResult(e, first is not None, delay, lead))

    alarms = merge(alarm_steps, cfg.merge_gap)
    false_alarms = sum(not in_a_window(a, b, windows) for a, b in alarms)
    warnings = merge(warn_steps, cfg.merge_gap)
    starts = [e.start for e in episodes]
    false_warnings = sum(
        not in_a_window(a, b, windows) and not any(a <= s <= b + cfg.lookback for s in starts)
        for a, b in warnings
    )
    clean = sum(not lab.label for lab in labels)
    return RunScore(
        group, len(steps), clean, results, len(alarms), false_alarms, len(warnings), false_warnings
    )


def _first_in(sorted_steps: Sequence[int], lo: int, hi: int) -> int | None:
    i = bisect.bisect_left(sorted_steps, lo)
    return sorted_steps[i] if i < len(sorted_steps) and sorted_steps[i] <= hi else None


@dataclass
class Summary:
    """The metrics of a group of scored runs."""

    runs: int = 0
    steps: int = 0
    clean_steps: int = 0
    episodes: int = 0
    detected: int = 0
    alarm_episodes: int = 0
    false_alarm_episodes: int = 0
    recall: float | None = None
    precision: float | None = None
    f1: float | None = None
    false_alarms_per_10k: float | None = None
    median_delay: float | None = None
    median_lead: float | None = None
    warned: int = 0
    false_warnings_per_10k: float | None = None
    by_kind: dict[str, dict[str, float | int | None]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def summarize(scores: Iterable[RunScore]) -> Summary:
    s = Summary()
    delays: list[int] = []
    leads: list[int] = []
    kinds: dict[str, list[EpisodeResult]] = {}
    false_warnings = 0
    for score in scores:
        s.runs += 1
        s.steps += score.steps
        s.clean_steps += score.clean_steps
        s.alarm_episodes += score.alarm_episodes
        s.false_alarm_episodes += score.false_alarm_episodes
        false_warnings += score.false_warning_episodes
        for r in score.episodes:
            s.episodes += 1
            s.detected += r.detected
            kinds.setdefault(r.episode.kind, []).append(r)
            if r.delay is not None:
                delays.append(r.delay)
            if r.lead is not None:
                leads.append(r.lead)
                s.warned += 1
    if s.episodes:
        s.recall = s.detected / s.episodes
    if s.alarm_episodes:
        s.precision = (s.alarm_episodes - s.false_alarm_episodes) / s.alarm_episodes
    if s.recall is not None and s.precision is not None:
        total = s.recall + s.precision
        s.f1 = 2 * s.recall * s.precision / total if total else 0.0
    elif s.recall == 0.0:  # episodes and no alarm at all
        s.f1 = 0.0
    if s.clean_steps:
        s.false_alarms_per_10k = s.false_alarm_episodes * 10_000 / s.clean_steps
        s.false_warnings_per_10k = false_warnings * 10_000 / s.clean_steps
    s.median_delay = float(statistics.median(delays)) if delays else None
    s.median_lead = float(statistics.median(leads)) if leads else None
    for kind, results in sorted(kinds.items()):
        kd = [r.delay for r in results if r.delay is not None]
        s.by_kind[kind] = {
            "episodes": len(results),
            "detected": sum(r.detected for r in results),
            "recall": sum(r.detected for r in results) / len(results),
            "median_delay": float(statistics.median(kd)) if kd else None,
        }
    return s
