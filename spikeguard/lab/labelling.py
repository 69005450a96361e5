"""Labelling real loss curves by written rules, so anyone can check (and redo) the labels.

The rules work on a run's logged points in order (a point is one logged
loss; AlgoPerf logs one minibatch's loss every 100 steps, so "20 points" is
2,000 optimizer steps there). They were written after looking at every curve
of ``real-spikes/`` (plots with ``python -m spikeguard.lab.labelling --plot``)
and chosen as round numbers a person would accept, not fitted to a detector:

1. **non_finite**: a NaN/inf loss. Each run of consecutive non-finite points
   is one event.
2. **baseline** of point *i*: the median of the previous ``window`` (20)
   finite points that are not inside an event (a spike does not teach the
   baseline, so a plateau cannot become its own reference). A point with
   fewer than ``min_history`` (20) such points before it is never labelled,
   which leaves the initial fall of the loss alone. (The BigScience windows
   hold 3-11 points: they are labelled with ``min_history`` 2 and ``excerpt``.)
3. An event **starts** at a point whose loss is at least ``spike_ratio``
   (1.5) x its baseline: on these curves every such point is plainly a spike
   on a plot, and the next-largest jumps (1.2-1.35x on ResNet and WMT) sit
   in the noise band of single-minibatch losses.
4. It **continues** through the following points while the loss stays at
   least ``recovery_ratio`` (1.25) x the baseline at its start; it ends at
   the last such point.
5. **kind**: an event that runs into a non-finite point, or is still above
   the recovery level when the run ends, is a **divergence**; otherwise one
   point is an **outlier_step** and two or more a **spike**. In an excerpt
   (``excerpt``: a window quoted from a longer run, like the BigScience
   logbook windows) the end of the file is not the end of the run, so an
   event cut off there is a spike, not a divergence.
6. **slow_rise**: the median of the last ``window`` points stays at least
   ``rise_ratio`` (1.1) x the lowest such median earlier in the run for
   ``rise_points`` (20) consecutive points, outside any other event; the
   event spans those points. (None of the AlgoPerf curves has one: their
   largest sustained rise is +6.8%, a late drift of ResNet-50.)

**The point rule** (:func:`point_rule_events`, ``--rule point``) is the
simplest rule that a reader can redo by hand, written before any detector ran on its
labels and used by ``spikeguard evaluate --held-out``: a point is labelled
when its loss is at or above ``ratio`` (1.3) x the median of the previous
``window`` (20) clean points, clean meaning finite and not itself labelled;
every NaN/inf point is labelled too. A point with fewer than 20 clean points
before it is never labelled (the first fall of the loss). Each maximal run of
consecutive labelled points is one event: ``non_finite`` for NaN/inf points,
``spike`` otherwise. It knows nothing of recovery, divergence or kinds beyond
that, so no detector's notion of them leaks into the labels; its file is
``spikeguard/lab/labels/<folder>.point-rule.csv``.

``events_detected.csv`` in the data folder was only an aid: every point it
lists lies inside one of these events, and the rules add one it lacks (the
DLRM run's x2.6 at step 34, under its robust-z bar). On the AlgoPerf set:
17 events (9 outlier_step, 6 spike, 1 divergence, 1 non_finite), no slow
rise; regenerate with ``python -m spikeguard.lab.labelling FOLDER``.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterable, NamedTuple, Sequence

from spikeguard.errors import SpikeguardError
from spikeguard.lab.runfile import open_text

KINDS = ("outlier_step", "spike", "slow_rise", "divergence", "non_finite")
LABEL_COLUMNS = ("file", "start_step", "end_step", "kind", "points", "peak_ratio")


class LabelFileError(SpikeguardError, ValueError):
    """A labels file could not be read; the message names the file and line."""


class LabelledEvent(NamedTuple):
    """One labelled event of one run: original step numbers, both ends inclusive."""

    start_step: int
    end_step: int
    kind: str
    points: int
    peak_ratio: float | None  # largest loss / baseline in the event (None: non-finite)


@dataclass(frozen=True)
class LabelRules:
    """The numbers of the labelling rules (see the module docstring)."""

    window: int = 20
    min_history: int = 20
    spike_ratio: float = 1.5
    recovery_ratio: float = 1.25
    rise_ratio: float = 1.1
    rise_points: int = 20
    excerpt: bool = False  # the curve is a window cut out of a run: its end is not the run's end


def label_events(
    steps: Sequence[int], losses: Sequence[float], rules: LabelRules | None = None
) -> list[LabelledEvent]:
    """The events of one run by the written rules, in step order."""
    r = rules or LabelRules()
    n = len(losses)
    kind_at: list[str] = [""] * n
    clean: deque[float] = deque(maxlen=r.window)
    events: list[LabelledEvent] = []
    i = 0
    while i < n:
        loss = losses[i]
        if not math.isfinite(loss):
            j = i
            while j + 1 < n and not math.isfinite(losses[j + 1]):
                j += 1
            events.append(LabelledEvent(steps[i], steps[j], "non_finite", j - i + 1, None))
            kind_at[i : j + 1] = ["non_finite"] * (j - i + 1)
            i = j + 1
            continue
        base = statistics.median(clean) if len(clean) >= r.min_history else None
        if base is None or base <= 0 or loss < r.spike_ratio * base:
            clean.append(loss)
            i += 1
            continue
        j = i
        while (
            j + 1 < n and math.isfinite(losses[j + 1]) and losses[j + 1] >= r.recovery_ratio * base
        ):
            j += 1
        unrecovered = (j + 1 == n and not r.excerpt) or (
            j + 1 < n and not math.isfinite(losses[j + 1])
        )
        kind = "divergence" if unrecovered else ("outlier_step" if j == i else "spike")
        peak = max(losses[i : j + 1]) / base
        events.append(LabelledEvent(steps[i], steps[j], kind, j - i + 1, round(peak, 3)))
        kind_at[i : j + 1] = [kind] * (j - i + 1)
        i = j + 1
    events += _slow_rises(steps, losses, kind_at, r)
    return sorted(events, key=lambda e: e.start_step)


@dataclass(frozen=True)
class PointRule:
    """The numbers of the point rule (see the module docstring)."""

    ratio: float = 1.3
    window: int = 20


def point_rule_events(
    steps: Sequence[int], losses: Sequence[float], rule: PointRule | None = None
) -> list[LabelledEvent]:
    """The events of one run by the point rule, in step order."""
    r = rule or PointRule()
    clean: deque[float] = deque(maxlen=r.window)
    flagged: list[str] = []  # per point: "", "spike" or "non_finite"
    ratios: list[float | None] = []
    for loss in losses:
        base = statistics.median(clean) if len(clean) == r.window else None
        if not math.isfinite(loss):
            flagged.append("non_finite")
            ratios.append(None)
        elif base is not None and base > 0 and loss >= r.ratio * base:
            flagged.append("spike")
            ratios.append(loss / base)
        else:
            flagged.append("")
            ratios.append(None)
            clean.append(loss)
    events = []
    i = 0
    while i < len(flagged):
        if not flagged[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(flagged) and flagged[j + 1] == flagged[i]:
            j += 1
        peaks = [x for x in ratios[i : j + 1] if x is not None]
        peak = round(max(peaks), 3) if peaks else None
        events.append(LabelledEvent(steps[i], steps[j], flagged[i], j - i + 1, peak))
        i = j + 1
    return events


def _slow_rises(steps, losses, kind_at, r: LabelRules) -> list[LabelledEvent]:
    recent: deque[float] = deque(maxlen=r.window)
    lowest = math.inf
    run: list[int] = []
    found: list[LabelledEvent] = []

    def close() -> None:
        if len(run) >= r.rise_points:
            peak = max(losses[k] for k in run) / lowest
            found.append(
                LabelledEvent(steps[run[0]], steps[run[-1]], "slow_rise", len(run), round(peak, 3))
            )
        run.clear()

    for k, loss in enumerate(losses):
        if kind_at[k] or not math.isfinite(loss):
            close()
            continue
        recent.append(loss)
        if len(recent) < r.window:
            continue
        level = statistics.median(recent)
        if level >= r.rise_ratio * lowest:
            run.append(k)
        else:
            close()
        lowest = min(lowest, level)
    close()
    return found


def point_labels(steps: Sequence[int], events: Iterable[LabelledEvent]):
    """A :class:`~spikeguard.lab.runfile.StepLabel` per step from a run's events."""
    from spikeguard.lab.runfile import StepLabel

    index = {step: i for i, step in enumerate(steps)}
    labels = [StepLabel(False, "")] * len(steps)
    for e in events:
        if e.start_step not in index or e.end_step not in index:
            raise LabelFileError(f"event {e} names a step the run does not have")
        for k in range(index[e.start_step], index[e.end_step] + 1):
            labels[k] = StepLabel(True, e.kind)
    return labels


def write_labels(
    target: str | os.PathLike | IO[str], labels: dict[str, list[LabelledEvent]]
) -> None:
    """A labels file: one row per event, ``file`` naming the run's CSV."""

    def rows(handle: IO[str]) -> None:
        out = csv.writer(handle, lineterminator="\n")
        out.writerow(LABEL_COLUMNS)
        for name in sorted(labels):
            for e in labels[name]:
                out.writerow(
                    [
                        name,
                        e.start_step,
                        e.end_step,
                        e.kind,
                        e.points,
                        "" if e.peak_ratio is None else e.peak_ratio,
                    ]
                )

    if isinstance(target, (str, os.PathLike)):
        with open(target, "w", encoding="utf-8", newline="") as handle:
            rows(handle)
    else:
        rows(target)


def read_labels(path: str | os.PathLike) -> dict[str, list[LabelledEvent]]:
    """``{file name: events}`` from a labels file (files with no event are absent)."""
    path = Path(path)
    try:
        handle = path.open(encoding="utf-8", newline="")
    except OSError as exc:
        raise LabelFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    out: dict[str, list[LabelledEvent]] = {}
    with handle:
        reader = csv.DictReader(handle)
        missing = [c for c in LABEL_COLUMNS[:4] if c not in (reader.fieldnames or ())]
        if missing:
            raise LabelFileError(f"{path}: header lacks {', '.join(missing)}")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if row["kind"] not in KINDS:
                raise LabelFileError(
                    f"{where}: kind {row['kind']!r} is not one of {', '.join(KINDS)}"
                )
            try:
                start, end = int(row["start_step"]), int(row["end_step"])
                points = int(row.get("points") or 0)
                peak = float(row["peak_ratio"]) if row.get("peak_ratio") else None
            except ValueError as exc:
                raise LabelFileError(f"{where}: {exc}") from None
            if end < start:
                raise LabelFileError(f"{where}: end_step {end} before start_step {start}")
            out.setdefault(row["file"], []).append(
                LabelledEvent(start, end, row["kind"], points, peak)
            )
    return out


def read_curve(path: str | os.PathLike) -> tuple[list[int], list[float]]:
    """Steps and losses of a ``step,loss[,...]`` CSV, maybe gzipped (extra columns ignored)."""
    steps: list[int] = []
    losses: list[float] = []
    path = Path(path)
    with open_text(path) as handle:
        for row in csv.DictReader(handle):
            try:
                steps.append(int(row["step"]))
                losses.append(float(row["loss"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise LabelFileError(f"{path}: row {row}: {exc}") from None
    return steps, losses


def curve_files(folder: str | os.PathLike) -> list[Path]:
    """The loss curves of ``folder``: its CSVs (``.csv`` or ``.csv.gz``) with a ``step`` and a
    ``loss`` column.

    (Other CSVs there, such as a labels file or ``events_detected.csv``, are not curves.)
    """
    found = []
    folder = Path(folder)
    for path in sorted([*folder.glob("*.csv"), *folder.glob("*.csv.gz")]):
        with open_text(path) as handle:
            header = [c.strip().lower() for c in next(csv.reader(handle), [])]
        if "step" in header and "loss" in header and "file" not in header:
            found.append(path)
    return found


def label_folder(folder: str | os.PathLike, rules: LabelRules | PointRule | None = None):
    """``{csv name: events}`` for every curve in ``folder`` (by the point rule when
    ``rules`` is a :class:`PointRule`)."""
    if isinstance(rules, PointRule):
        return {
            path.name: point_rule_events(*read_curve(path), rules) for path in curve_files(folder)
        }
    return {path.name: label_events(*read_curve(path), rules) for path in curve_files(folder)}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m spikeguard.lab.labelling FOLDER [--rule point] [--out FILE] [--plot PNG]``."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m spikeguard.lab.labelling",
        description="label the curves of a folder by the written rules",
    )
    parser.add_argument("folder")
    parser.add_argument("--out", help="labels CSV to write (default: print)")
    parser.add_argument(
        "--min-history",
        type=int,
        default=LabelRules.min_history,
        help="clean points a baseline needs (default %(default)s)",
    )
    parser.add_argument(
        "--excerpt",
        action="store_true",
        help="the curves are windows cut out of runs (their end is not the run's end)",
    )
    parser.add_argument(
        "--rule",
        choices=("events", "point"),
        default="events",
        help="events: the event rules (default); point: the 1.3x point rule",
    )
    parser.add_argument(
        "--plot", help="PNG of every curve with its labelled events (needs matplotlib)"
    )
    args = parser.parse_args(argv)
    if not Path(args.folder).is_dir():
        print(f"{args.folder}: not a folder", file=sys.stderr)
        return 2
    rules: LabelRules | PointRule = (
        PointRule()
        if args.rule == "point"
        else LabelRules(min_history=args.min_history, excerpt=args.excerpt)
    )
    labels = label_folder(args.folder, rules)
    write_labels(args.out or sys.stdout, labels)
    if args.plot:
        _plot(args.folder, labels, args.plot)
    return 0


_COLOURS = {
    "outlier_step": "tab:orange",
    "spike": "tab:red",
    "slow_rise": "tab:purple",
    "divergence": "black",
    "non_finite": "tab:gray",
}


def _plot(folder, labels, target) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(labels)
    fig, axes = plt.subplots(len(names), 1, figsize=(13, 2.4 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        steps, losses = read_curve(Path(folder) / name)
        finite = [(s, l) for s, l in zip(steps, losses) if math.isfinite(l)]
        ax.plot([s for s, _ in finite], [l for _, l in finite], lw=0.6)
        ax.set_yscale("log")
        for e in labels[name]:
            ax.axvspan(
                e.start_step,
                e.end_step + 0.5 * max(1, steps[1] - steps[0]),
                alpha=0.35,
                color=_COLOURS[e.kind],
                label=e.kind,
            )
        handles = dict(zip(*ax.get_legend_handles_labels()[::-1]))
        if handles:
            ax.legend(handles.values(), handles.keys(), fontsize=7, loc="upper right")
        ax.set_title(name, fontsize=8)
    fig.tight_layout()
    fig.savefig(target, dpi=60)


if __name__ == "__main__":
    raise SystemExit(main())
