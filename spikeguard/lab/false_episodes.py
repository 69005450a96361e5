"""Where false alarms come from: each false alarm episode, by what raised it.

An alarm episode (:mod:`spikeguard.lab.evaluation`: alarms at most ``merge_gap``
steps apart) is false when it overlaps no labelled episode's window. This module
names the sources of each such episode: for a decision, its type, urgency,
the detectors that flagged it and its first rule
(``"slow_rise|low|statistical|loss_level_shift"``); for an update the Guard's
skip rule skipped, ``"guard_skip"``. An episode's class is its sources, sorted
and joined by ``" + "``; tallying the classes over a set of runs says which
rule to look at first.

    python -m spikeguard.lab.false_episodes test          # the test half of the run families
    python -m spikeguard.lab.false_episodes development   # the development half
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Iterable, NamedTuple, Sequence

from spikeguard.lab.evaluation import (
    EvaluationConfig,
    episodes_from_labels,
    in_a_window,
    is_alarm,
    label_windows,
    marks_from_decisions,
    merge,
)
from spikeguard.lab.runfile import StepLabel

GUARD_SKIP = "guard_skip"


class FalseEpisode(NamedTuple):
    """One false alarm episode: its first and last alarm step, and its class."""

    start: int
    end: int
    sources: str


def source_of(decision) -> str:
    """One anomalous decision as ``type|urgency|detectors|first rule``."""
    kind = getattr(decision.type, "value", decision.type)
    urgency = getattr(decision.urgency, "value", decision.urgency)
    by = ",".join(sorted(decision.flagged_by or ())) or "-"
    rule = decision.rules[0] if decision.rules else "-"
    return f"{kind}|{urgency}|{by}|{rule}"


def false_episodes(
    steps: Sequence[int],
    labels: Sequence[StepLabel] | None,
    decisions: Iterable,
    local_skips: Iterable[int] = (),
    config: EvaluationConfig | None = None,
) -> list[FalseEpisode]:
    """The false alarm episodes of one run, scored as :func:`~spikeguard.lab.evaluation.score_run`
    scores them (warnings are not alarms), each with its sources."""
    cfg = config or EvaluationConfig()
    labels = labels or [StepLabel(False, "")] * len(steps)
    windows = label_windows(episodes_from_labels(steps, labels), cfg)
    sources: dict[int, set[str]] = collections.defaultdict(set)
    decisions = list(decisions)
    for d, mark in zip(decisions, marks_from_decisions(decisions)):
        if is_alarm(mark):
            sources[d.step].add(source_of(d))
    for step in local_skips:
        sources[step].add(GUARD_SKIP)
    out = []
    for a, b in merge(sorted(sources), cfg.merge_gap):
        if in_a_window(a, b, windows):
            continue
        seen = set().union(*(sources[s] for s in range(a, b + 1) if s in sources))
        out.append(FalseEpisode(a, b, " + ".join(sorted(seen))))
    return out


def tally(episodes: Iterable[FalseEpisode]) -> list[tuple[str, int]]:
    """Episodes per class, the most frequent first."""
    return collections.Counter(e.sources for e in episodes).most_common()


def main(argv: list[str] | None = None) -> int:
    from spikeguard.lab.families import case_of, generate, seeds_of
    from spikeguard.lab.false_actions import guarded_run

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("half", choices=("development", "test"))
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--json", action="store_true", help="every episode, as JSON")
    args = parser.parse_args(argv)
    found: list[tuple[str, FalseEpisode]] = []
    for seed in seeds_of(args.half, args.runs):
        run = generate(case_of(seed))
        guarded = guarded_run(run.events)
        steps = [e.step for e in run.events]
        for episode in false_episodes(steps, run.labels, guarded.decisions, guarded.local_skips):
            found.append((run.case.name, episode))
    if args.json:
        json.dump([{"run": r, **e._asdict()} for r, e in found], sys.stdout, indent=1)
        return 0
    print(f"{len(found)} false alarm episodes in {args.runs} runs of the {args.half} half")
    for sources, count in tally(e for _, e in found):
        print(f"{count:5d}  {sources}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
