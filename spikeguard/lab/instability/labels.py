"""The written label rule, and lab runs as run files any detector or backtest can read.

The rule, independent of every detector: a step of a run is *unstable* when
the run's trailing mean loss over ``window`` steps exceeds its healthy twin's
(same seed, same batches) by more than ``margin`` nats, or its loss is not
finite. The *loss alarm* is the first step that starts ``hold`` consecutive
unstable steps: the point from which the run is, for good, behind the run
with the fix on. Its twin has no unstable step by construction (it is the
reference); a healthy twin's false warnings are counted on its signals.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from spikeguard.lab.instability.train import LabRun
from spikeguard.lab.runfile import StepLabel, write_csv
from spikeguard.schemas import StepEvent

WINDOW = 20
MARGIN = 0.15  # nats: about 3x the std of a 20-step mean of this model's batch loss
HOLD = 10


def trailing_mean(values: Sequence[float], window: int = WINDOW) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def unstable_steps(
    losses: Sequence[float], twin: Sequence[float], margin: float = MARGIN, window: int = WINDOW
) -> list[bool]:
    """Per step: behind the twin by more than ``margin`` (trailing means), or not finite."""
    mine, theirs = trailing_mean(losses, window), trailing_mean(twin, window)
    return [not math.isfinite(a) or a - b > margin for a, b in zip(mine, theirs)]


def loss_alarm(unstable: Sequence[bool], hold: int = HOLD) -> int | None:
    """The first step that starts ``hold`` consecutive unstable steps (None: no alarm)."""
    streak = 0
    for i, flag in enumerate(unstable):
        streak = streak + 1 if flag else 0
        if streak >= hold:
            return i - hold + 1
    return None


def step_labels(unstable: Sequence[bool], kind: str) -> list[StepLabel]:
    return [StepLabel(True, kind) if u else StepLabel(False) for u in unstable]


def write_steps(
    path: Path,
    run_id: str,
    losses: Sequence[float],
    grad_norms: Sequence[float],
    lrs: Sequence[float],
    labels: Sequence[StepLabel],
) -> None:
    """``path``.csv: the run file (step, loss, grad_norm, lr, label, kind; a synthetic
    one-second clock), which every detector and the backtest read."""
    events = [
        StepEvent(run_id=run_id, step=i, loss=loss, grad_norm=g, lr=lr, time=float(i))
        for i, (loss, g, lr) in enumerate(zip(losses, grad_norms, lrs))
    ]
    write_csv(path.with_suffix(".csv"), events, labels)


def write_signals(path: Path, run: LabRun) -> None:
    """``path``.signals.jsonl: each step's mechanism signals, one JSON object a line."""
    with path.with_suffix(".signals.jsonl").open("w", encoding="utf-8") as out:
        for r in run.steps:
            s = r.signals
            row = {"step": r.step, "attention_max": s.attention_max, "z": s.z}
            row["update_ratio"] = s.update_ratio
            out.write(json.dumps(row) + "\n")
