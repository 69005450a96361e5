"""spikeguard beside the six-sigma and robust-z rules, on the same runs and the same labels.

Every run goes through three systems:

- **spikeguard**: the whole offline pipeline on the steps as the live Guard
  would have published them, its skip rule applied
  (:func:`~spikeguard.lab.false_actions.guarded_run`), the decisions handed to
  the recovery policy. Its alarms are the pipeline's anomalous decisions plus
  the Guard's local skips (a skipped update is an answer to a spike).
- **six_sigma** (OLMo-core): the loss or the gradient norm above the mean + 6
  standard deviations of its previous 128 values
  (:class:`~spikeguard.lab.baselines.SixSigmaBaseline`).
- **robust_z** (axolotl style): the loss or the gradient norm more than 6
  robust sigmas (1.4826 MAD) above the median of the last 100 accepted values
  (:class:`~spikeguard.lab.trainer_rules.AxolotlRobustZ`).

Per set of runs (a half of the run families of :mod:`spikeguard.lab.families`,
or a real data set): recall per labelled episode, precision per alarm episode
and false alarms per 10k clean steps (:mod:`spikeguard.lab.evaluation`); and
on the set's healthy runs (no labelled step) the **false actions** per 10k
steps and the share of steps flagged: spikeguard's stops, rollbacks, LR
cuts, skipped batches and local skips, and its alarm episodes of high or
critical urgency (a count); each rule's flagged steps (each one a skipped
update in its trainer). For the run families, also per wander kind,
as wander is what fooled the detectors before. The JSON report lists every
run too (episodes found, false alarms, actions), to find the runs behind a figure.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

from spikeguard.lab.baselines import SixSigmaBaseline, flag_run
from spikeguard.lab.evaluation import (
    EvaluationConfig,
    Mark,
    RunScore,
    marks_from_decisions,
    merge,
    score_run,
    summarize,
)
from spikeguard.lab.false_actions import guarded_run
from spikeguard.lab.runfile import StepLabel
from spikeguard.lab.trainer_rules import AxolotlRobustZ
from spikeguard.schemas import StepEvent, Urgency

SPIKEGUARD, SIX_SIGMA, ROBUST_Z = "spikeguard", "six_sigma", "robust_z"
SYSTEMS = {
    SPIKEGUARD: "pipeline + policy + the Guard's skip rule",
    SIX_SIGMA: "OLMo-core: > mean + 6 sd of the previous 128 values (loss, grad norm)",
    ROBUST_Z: "axolotl-style: robust z > 6 (median, 1.4826 MAD of the last 100 accepted)",
}
_RULES = {SIX_SIGMA: SixSigmaBaseline, ROBUST_Z: AxolotlRobustZ}
_HIGH = (Urgency.HIGH, Urgency.CRITICAL)
ACTIONS = ("stops", "rollbacks", "lr_cuts", "skipped_batches", "local_skips")
#: Alarm episodes (anomalous decisions at most ``merge_gap`` steps apart) of high or critical
#: urgency: on a healthy run, each is an incident the pipeline escalated for nothing.
HIGH_EPISODES = "high_urgency_episodes"
OUTLIER = "outlier_step"


class ScoredRun(NamedTuple):
    """One run to compare on: its set, its steps and labels (None: healthy), its wander kind."""

    group: str
    events: list[StepEvent]
    labels: list[StepLabel] | None
    wander: str = ""


def system_run(name: str, events, settings=None) -> tuple[list[Mark], dict[str, int]]:
    """One system's marks over a run, and what it did (its actions, or the steps it flagged)."""
    if name == SPIKEGUARD:
        run = guarded_run(events, settings)
        marks = marks_from_decisions(run.decisions)
        marks += [Mark(step, True, type=OUTLIER) for step in run.local_skips]
        high = [d.step for d in run.decisions if d.is_anomaly and d.urgency in _HIGH]
        gap = EvaluationConfig().merge_gap
        counts = {**run.actions._asdict(), "local_skips": len(run.local_skips)}
        return marks, {**counts, HIGH_EPISODES: len(merge(high, gap))}
    marks = flag_run(_RULES[name](), events)
    return marks, {"flagged": sum(m.is_anomaly for m in marks)}


class _Tally:
    """One system's figures on one set, as runs come in."""

    def __init__(self, name: str) -> None:
        self.scores: list[RunScore] = []
        kept = (*ACTIONS, HIGH_EPISODES) if name == SPIKEGUARD else ("flagged",)
        self.actions = dict.fromkeys(kept, 0)
        self.flagged_steps = self.healthy_steps = 0
        self.wander: dict[str, list[int]] = {}  # wander -> [steps, actions]
        self.runs: list[dict] = []  # per run, to find the runs behind a figure

    def add(self, run: ScoredRun, score: RunScore, marks: list[Mark], counts: dict) -> None:
        self.scores.append(score)
        self.runs.append(
            {
                "run": run.events[0].run_id if run.events else "",
                "episodes": len(score.episodes),
                "found": sum(r.detected for r in score.episodes),
                "false_alarms": score.false_alarm_episodes,
                "actions": {k: v for k, v in counts.items() if v},
            }
        )
        if score.episodes:
            return
        steps = len(run.events)
        self.healthy_steps += steps
        self.flagged_steps += len({m.step for m in marks if m.is_anomaly})
        for key, value in counts.items():
            self.actions[key] += value
        if run.wander:
            row = self.wander.setdefault(run.wander, [0, 0])
            row[0] += steps
            row[1] += sum(v for k, v in counts.items() if k != HIGH_EPISODES)

    def figures(self, name: str) -> dict:
        rate = 10_000 / max(self.healthy_steps, 1)
        return {
            "title": SYSTEMS[name],
            "summary": summarize(self.scores).as_dict(),
            "healthy_steps": self.healthy_steps,
            "flagged_percent": 100 * self.flagged_steps / max(self.healthy_steps, 1),
            "false_actions": dict(self.actions),
            "false_actions_per_10k": {k: v * rate for k, v in self.actions.items()},
            "by_wander_per_10k": {
                w: acted * 10_000 / max(steps, 1)
                for w, (steps, acted) in sorted(self.wander.items())
            },
            "runs": self.runs,
        }


def compare(
    runs: Iterable[ScoredRun],
    settings=None,
    systems: Iterable[str] = tuple(SYSTEMS),
    on_run: Callable[[ScoredRun], None] | None = None,
) -> dict:
    """Every run through every system: ``{"sets": {set: {system: figures}}, "steps": n}``."""
    config = EvaluationConfig()
    systems = list(systems)
    tallies: dict[str, dict[str, _Tally]] = {}
    total = 0
    for run in runs:
        steps = [e.step for e in run.events]
        total += len(steps)
        mine = tallies.setdefault(run.group, {name: _Tally(name) for name in systems})
        for name in systems:
            marks, counts = system_run(name, run.events, settings)
            score = score_run(steps, run.labels, marks, config, run.group)
            mine[name].add(run, score, marks, counts)
        if on_run is not None:
            on_run(run)
    return {
        "steps": total,
        "sets": {
            group: {name: tally.figures(name) for name, tally in by_system.items()}
            for group, by_system in tallies.items()
        },
    }


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def render(report: dict, title: str) -> str:
    """The report as text: scores per set and system, then the false actions on healthy runs."""
    lines = [f"== {title}: {report['steps']:,} steps"]
    table = [
        [
            "set",
            "system",
            "runs",
            "episodes",
            "recall",
            "precision",
            "F1",
            "FA/10k clean",
            "recall by kind",
        ]
    ]
    for group, by_system in report["sets"].items():
        for name, f in by_system.items():
            s = f["summary"]
            kinds = "; ".join(
                f"{k} {v['detected']}/{v['episodes']}" for k, v in s["by_kind"].items()
            )
            table.append(
                [
                    group,
                    name,
                    str(s["runs"]),
                    str(s["episodes"]),
                    _fmt(s["recall"]),
                    _fmt(s["precision"]),
                    _fmt(s["f1"]),
                    _fmt(s["false_alarms_per_10k"], 2),
                    kinds,
                ]
            )
    lines += _aligned(table, left=(0, 1, 8))
    lines.append("")
    lines.append(
        "== on the healthy runs (no labelled step): false actions per 10k steps "
        "(a rule's flag skips an update), and spikeguard's high/critical alarm episodes (a count)"
    )
    table = [
        [
            "set",
            "system",
            "steps",
            "% flagged",
            "high/crit episodes",
            "stops",
            "rollbacks",
            "LR cuts",
            "skipped batches",
            "local skips",
            "flagged",
            "all, by wander",
        ]
    ]
    for group, by_system in report["sets"].items():
        for name, f in by_system.items():
            if not f["healthy_steps"]:
                continue
            fa = f["false_actions_per_10k"]
            wander = "; ".join(f"{w} {_fmt(v, 1)}" for w, v in f["by_wander_per_10k"].items())
            table.append(
                [group, name, f"{f['healthy_steps']:,}", _fmt(f["flagged_percent"], 3)]
                + [_fmt(f["false_actions"].get(HIGH_EPISODES))]
                + [_fmt(fa[k], 1) if k in fa else "-" for k in (*ACTIONS, "flagged")]
                + [wander]
            )
    lines += _aligned(table, left=(0, 1, 11))
    return "\n".join(lines)


def _aligned(table: list[list[str]], left: tuple[int, ...]) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return [
        "  ".join(
            c.ljust(w) if j in left else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in table
    ]
