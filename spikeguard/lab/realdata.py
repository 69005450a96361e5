"""The real evaluation sets: labelled curves with real spikes, and healthy runs.

The data sets live in the repository's ``data/`` folder (each source with
its LICENSE and SOURCES.md), not in the installed package: from a clone,
:func:`data_dir` finds them; elsewhere pass a path, and a missing one raises
:class:`RealDataError` saying what to pass. The labels of the spike set are data in the lab
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
from spikeguard.lab.runfile import RunFileError, StepLabel, plain_path, read_steps
from spikeguard.schemas import StepEvent

LABELS_DIR = Path(__file__).with_name("labels")
#: The repository's data folder, when the package runs from a clone (an editable install).
REPO_DATA = Path(__file__).resolve().parents[2] / "data"
#: The data sets inside it.
REAL_SPIKES_DIR, MODDED_NANOGPT_DIR, MLPERF_BERT_DIR, HEALTHY_DIR = (
    "real-spikes",
    "modded-nanogpt",
    "mlperf-bert",
    "healthy",
)
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


def data_dir(name: str) -> Path:
    """``data/<name>`` of the repository this package runs from; a clear error outside a clone."""
    folder = REPO_DATA / name
    if not folder.is_dir():
        raise RealDataError(
            f"data set {name!r} not found at {folder}: the data sets ship with the source "
            "repository (its data/ folder), not with the installed package; run from a clone "
            "(pip install -e .) or pass the folder's path"
        )
    return folder


def spike_folder(path: str | os.PathLike | None = None) -> Path:
    """The folder of labelled curves: ``path`` itself, or its ``algoperf_submissions``
    (default: the repository's ``data/real-spikes``)."""
    folder = data_dir(REAL_SPIKES_DIR) if path is None else Path(path)
    if not folder.is_dir():
        raise RealDataError(
            f"real-spike data not found at {folder}; pass the folder that holds the curves "
            f"(the repository has them in data/{REAL_SPIKES_DIR})"
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


def load_spike_set(
    path: str | os.PathLike | None = None, labels: str | os.PathLike | None = None
) -> list[RealRun]:
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
        runs.append(RealRun(plain_path(path).stem, events, point_labels(steps, mine), steps, mine))
    return runs


def load_healthy_set(path: str | os.PathLike | None = None) -> list[RealRun]:
    """Every curve of a folder of healthy runs (no labels: every alarm is a false one);
    default: the repository's ``data/modded-nanogpt``."""
    folder = data_dir(MODDED_NANOGPT_DIR) if path is None else Path(path)
    if not folder.is_dir():
        raise RealDataError(
            f"healthy-run data not found at {folder}; pass the folder of healthy runs "
            f"(the repository has them in data/{MODDED_NANOGPT_DIR}, data/{MLPERF_BERT_DIR}, "
            f"data/{HEALTHY_DIR})"
        )
    files = curve_files(folder)
    if not files:
        raise RealDataError(f"{folder}: no step,loss CSV in it")
    runs = []
    for path in files:
        events, steps = _read(path)
        runs.append(RealRun(plain_path(path).stem, events, None, steps, []))
    return runs


def _read(path: Path) -> tuple[list[StepEvent], list[int]]:
    try:
        events, _ = read_steps(path)
    except RunFileError as exc:
        raise RealDataError(str(exc)) from None
    steps = [e.step for e in events]
    renumbered = [e.model_copy(update={"step": i, "time": float(i)}) for i, e in enumerate(events)]
    return renumbered, steps


def healthy_kinds(paths: list[str | os.PathLike] | None = None) -> dict[str, list[RealRun]]:
    """Healthy runs grouped by kind: a CSV is one kind (its name), a folder is one kind (its name,
    all its curves). Default: each run of the repository's ``data/healthy`` (made by
    :mod:`spikeguard.lab.healthy_runs`), then ``data/modded-nanogpt`` and ``data/mlperf-bert``."""
    if not paths:
        made = data_dir(HEALTHY_DIR)
        paths = [*curve_files(made), data_dir(MODDED_NANOGPT_DIR), data_dir(MLPERF_BERT_DIR)]
    kinds: dict[str, list[RealRun]] = {}
    for path in map(Path, paths):
        if path.is_file():
            events, steps = _read(path)
            name = plain_path(path).stem
            kinds[name] = [RealRun(name, events, None, steps, [])]
        else:
            kinds[path.name] = load_healthy_set(path)
    return kinds
