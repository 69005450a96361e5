"""The real evaluation sets: labelled curves with real spikes, and healthy runs.

Neither set ships with the package (the project's reference data lives in
``../shared/data``, which a user's clone lacks), so every path is an
argument, and a missing one raises :class:`RealDataError` saying what to
pass. The labels of the spike set are data in the lab
(``spikeguard/lab/labels/<folder>.csv``, made by
:mod:`spikeguard.lab.labelling`); a ``labels.csv`` inside the folder wins.

Each logged point becomes one :class:`StepEvent` numbered 0, 1, 2, ... in
file order: the detectors and the baselines see one event per logged point,
and every window, warm-up and delay is counted in logged points (for the
AlgoPerf logs one point is 100 optimizer steps). The original step numbers
stay on :attr:`RealRun.steps` for reporting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from spikeguard.errors import SpikeguardError
from spikeguard.lab.labelling import LabelledEvent, curve_files, point_labels, read_labels
from spikeguard.lab.runfile import RunFileError, StepLabel, read_steps
from spikeguard.schemas import StepEvent

LABELS_DIR = Path(__file__).with_name("labels")
#: Inside a ``real-spikes`` folder, the curves that are scored (the BigScience
#: windows, 3-11 points each, are shorter than any rule's warm-up).
SPIKE_SUBFOLDER = "algoperf_submissions"


class RealDataError(SpikeguardError, ValueError):
    """A real data set is missing or unreadable; the message says what to pass."""


@dataclass
class RealRun:
    name: str
    events: list[StepEvent]  # steps renumbered 0..n-1
    labels: list[StepLabel] | None  # None: a healthy (clean) run
    steps: list[int]  # the original step of each event
    truth: list[LabelledEvent]


def spike_folder(path: str | os.PathLike) -> Path:
    """The folder of labelled curves: ``path`` itself, or its ``algoperf_submissions``."""
    folder = Path(path)
    if not folder.is_dir():
        raise RealDataError(
            f"real-spike data not found at {folder}: it is not part of the repository; "
            "pass the folder that holds the curves (e.g. ../shared/data/real-spikes)"
        )
    if (folder / SPIKE_SUBFOLDER).is_dir():
        return folder / SPIKE_SUBFOLDER
    return folder


def labels_for(folder: Path, labels: str | os.PathLike | None = None) -> Path:
    """The labels file of ``folder``: ``labels``, else ``folder/labels.csv``, else the lab's."""
    for candidate in (labels, folder / "labels.csv", LABELS_DIR / f"{folder.name}.csv"):
        if candidate is not None and Path(candidate).is_file():
            return Path(candidate)
    if labels is not None:
        raise RealDataError(f"labels file {labels} not found")
    raise RealDataError(
        f"no labels for {folder}: no labels.csv there and no {LABELS_DIR / (folder.name + '.csv')}; "
        "write one with `python -m spikeguard.lab.labelling FOLDER --out FILE` and pass --labels FILE"
    )


def load_spike_set(path: str | os.PathLike, labels: str | os.PathLike | None = None) -> list[RealRun]:
    """Every curve of the real-spike folder with its labels (a curve absent from them: no event)."""
    folder = spike_folder(path)
    truth = read_labels(labels_for(folder, labels))
    files = curve_files(folder)
    if not files:
        raise RealDataError(f"{folder}: no step,loss CSV in it")
    unknown = sorted(set(truth) - {f.name for f in files})
    if unknown:
        raise RealDataError(f"the labels name curves that {folder} lacks: {', '.join(unknown)}")
    runs = []
    for path in files:
        events, steps = _read(path)
        mine = truth.get(path.name, [])
        runs.append(RealRun(path.stem, events, point_labels(steps, mine), steps, mine))
    return runs


def load_healthy_set(path: str | os.PathLike) -> list[RealRun]:
    """Every curve of a folder of healthy runs (no labels: every alarm is a false one)."""
    folder = Path(path)
    if not folder.is_dir():
        raise RealDataError(
            f"healthy-run data not found at {folder}: it is not part of the repository; "
            "pass the folder of healthy runs (e.g. ../shared/data/modded-nanogpt)"
        )
    files = curve_files(folder)
    if not files:
        raise RealDataError(f"{folder}: no step,loss CSV in it")
    runs = []
    for path in files:
        events, steps = _read(path)
        runs.append(RealRun(path.stem, events, None, steps, []))
    return runs


def _read(path: Path) -> tuple[list[StepEvent], list[int]]:
    try:
        events, _ = read_steps(path)
    except RunFileError as exc:
        raise RealDataError(str(exc)) from None
    steps = [e.step for e in events]
    renumbered = [e.model_copy(update={"step": i, "time": float(i)}) for i, e in enumerate(events)]
    return renumbered, steps
