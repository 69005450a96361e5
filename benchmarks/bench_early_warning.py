"""Does the update norm warn before the loss does? Lead time on real instabilities, false warnings on healthy runs.

Small real torch models train on the CPU, seeded, under the Guard in observe
mode (it publishes every step event, ``update_norm`` and ``param_norm``
included, and changes nothing, so an instability runs its course as it would
unguarded). Two models:

- ``mlp``: a 32-128-128-10 MLP classifying a random teacher's labels (10 %
  label noise), Adam lr 1e-3, batch 32;
- ``lm``: a character language model (8 characters of context, embedding 16,
  hidden 128) on text from a random order-2 Markov chain, Adam lr 3e-3, batch 32.

Runs of each model, ``--steps`` steps (default 800), onset at ``--onset`` (500):

- healthy: constant LR (3 seeds), linear warm-up + cosine, and a warm restart
  (the LR back to its peak at the onset step);
- ``lr_ramp``: from the onset the LR grows x1.05 per step (a schedule gone wrong);
- ``lr_jump``: the LR jumps x30 at the onset;
- ``poison``: one poisoned batch at the onset (mlp: inputs x30 and random labels;
  lm: uniformly random characters).

Each run's events are judged offline by:

- ``pipeline``: every detector and fusion as configured by default (``backtest``):
  the first anomalous decision is "the loss alarm";
- ``update``: the shared outlier model (``processors/outlier_model.py``, its
  default false-alarm rate, the LR-jump grace included) on ``log(update_norm)``;
  ``update_per_lr``: the same on ``log(update_norm / lr)`` (what the update says
  beyond the LR the event already carries: Adam's update scales with the LR);
- ``predictor``: the predictor switched on, fed the events as published, and
  ``predictor_no_update``: the same with ``update_norm`` removed from them;
- ``forest``: the pipeline with the isolation forest on (``ml.forest``), and
  ``forest_no_update``: the same without ``update_norm`` (its ``update_z`` feature).

A warning is an episode (consecutive alarmed steps count once). One that
starts earlier than ``onset - horizon`` (50 steps), and any on a healthy run,
is false. Lead = loss alarm step minus warning step (positive: the
warning came first); a run whose loss alarm never comes counts the warning as
a catch with lead measured against the end of the run.

    python benchmarks/bench_early_warning.py [--steps 800] [--onset 500] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import tempfile
from typing import Callable, NamedTuple

import torch
from torch import nn

from spikeguard.bus import EmbeddedBus
from spikeguard.lab.backtest import backtest_events
from spikeguard.processors.detectors.predictor import PredictorConfig, PredictorDetector
from spikeguard.processors.outlier_model import OutlierConfig, log_of
from spikeguard.producers import Guard, GuardConfig
from spikeguard.schemas import StepEvent, Topics, decode
from spikeguard.settings import load_settings

HORIZON = 50
HEALTHY = ("healthy_s0", "healthy_s1", "healthy_s2", "healthy_cosine", "healthy_restart")
FAULTS = ("lr_ramp", "lr_jump", "poison")
SIGNALS = (
    "update",
    "update_per_lr",
    "predictor",
    "predictor_no_update",
    "forest",
    "forest_no_update",
)


class Task(NamedTuple):
    model: nn.Module
    lr: float
    batch: Callable[[int, bool], tuple[torch.Tensor, torch.Tensor]]  # (step, poisoned) -> (x, y)
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def mlp_task(seed: int) -> Task:
    gen = torch.Generator().manual_seed(1000 + seed)
    teacher = [torch.randn(32, 64, generator=gen), torch.randn(64, 10, generator=gen)]
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10)
    )

    def batch(step: int, poisoned: bool) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        x = torch.randn(32, 32, generator=g)
        y = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(1)
        noisy = torch.rand(32, generator=g) < 0.1
        y = torch.where(noisy, torch.randint(0, 10, (32,), generator=g), y)
        if poisoned:
            return x * 30.0, torch.randint(0, 10, (32,), generator=g)
        return x, y

    return Task(model, 1e-3, batch, lambda m, x, y: nn.functional.cross_entropy(m(x), y))


def lm_task(seed: int, vocab: int = 27, context: int = 8) -> Task:
    gen = torch.Generator().manual_seed(2000 + seed)
    # An order-2 Markov chain with peaked transitions: a learnable, noisy text.
    logits = torch.randn(vocab, vocab, vocab, generator=gen) * 2.5
    probs = torch.softmax(logits, dim=-1)
    text = torch.zeros(200_000, dtype=torch.long)
    text[:2] = torch.randint(0, vocab, (2,), generator=gen)
    draws = torch.rand(len(text), generator=gen)
    cdf = probs.cumsum(-1)
    for i in range(2, len(text)):
        text[i] = min(int(torch.searchsorted(cdf[text[i - 2], text[i - 1]], draws[i])), vocab - 1)
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Embedding(vocab, 16),
        nn.Flatten(),
        nn.Linear(16 * context, 128),
        nn.GELU(),
        nn.Linear(128, vocab),
    )

    def batch(step: int, poisoned: bool) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        if poisoned:
            return (
                torch.randint(0, vocab, (32, context), generator=g),
                torch.randint(0, vocab, (32,), generator=g),
            )
        start = torch.randint(0, len(text) - context - 1, (32,), generator=g)
        idx = start[:, None] + torch.arange(context + 1)
        chunk = text[idx]
        return chunk[:, :context], chunk[:, context]

    return Task(model, 3e-3, batch, lambda m, x, y: nn.functional.cross_entropy(m(x), y))


TASKS = {"mlp": mlp_task, "lm": lm_task}


def lr_at(kind: str, step: int, base: float, steps: int, onset: int) -> float:
    if kind == "healthy_cosine":
        warm = 100
        if step < warm:
            return base * (step + 1) / warm
        return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warm) / (steps - warm))))
    if kind == "healthy_restart":  # cosine to the onset, then back to the peak (SGDR)
        start, length = (0, onset) if step < onset else (onset, steps - onset)
        return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - start) / length)))
    if kind == "lr_ramp" and step >= onset:
        return base * min(1.05 ** (step - onset + 1), 1e4)
    if kind == "lr_jump" and step >= onset:
        return base * 30.0
    return base


def record(task_name: str, kind: str, steps: int, onset: int, workdir: str) -> list[StepEvent]:
    """One run under the Guard (observe mode): its step events as published."""
    seed = int(kind[-1]) if kind.startswith("healthy_s") else 0
    task = TASKS[task_name](seed)
    optimizer = torch.optim.Adam(task.model.parameters(), lr=task.lr)
    bus, topics = EmbeddedBus(), Topics()
    guard = Guard(
        task.model,
        optimizer,
        run_id=f"{task_name}-{kind}",
        bus=bus,
        topics=topics,
        config=GuardConfig(
            checkpoint_dir=f"{workdir}/{task_name}-{kind}",
            checkpoint_every=0,
            resume=False,
            mode="observe",
            unprotected_after_s=3600,
        ),
    )
    guard.halves.started = True  # no checkpoint: nothing will be rolled back in observe mode
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(kind, step, task.lr, steps, onset)
        x, y = task.batch(step, kind == "poison" and step == onset)
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(task.model, x, y)
        loss.backward()
        guard.step(loss)
        if not math.isfinite(float(loss.detach())):
            break  # the run is dead; what came before is what a warning could have used
    guard.close()
    events = []
    for r in bus.read_all(topics.steps):
        assert r.value is not None  # the guard publishes every step with its bytes
        events.append(decode(r.value, StepEvent))
    bus.close()
    return events


def pipeline_alarms(events: list[StepEvent], settings) -> list[int]:
    return sorted({d.step for d in backtest_events(events, settings) if d.is_anomaly})


def without_update(events: list[StepEvent]) -> list[StepEvent]:
    return [e.model_copy(update={"update_norm": None}) for e in events]


def update_alarms(events: list[StepEvent], per_lr: bool = False) -> list[int]:
    model = OutlierConfig().model()
    found = []
    for e in events:
        if e.update_norm is None or not math.isfinite(e.update_norm) or e.update_norm <= 0.0:
            continue
        y = log_of(e.update_norm / e.lr if per_lr and e.lr else e.update_norm)
        judged = model.judge(y, e.lr)
        if judged.elevated:
            found.append(e.step)
        model.advance(y, judged, e.lr)
    return found


def predictor_alarms(events: list[StepEvent]) -> list[int]:
    detector = PredictorDetector(PredictorConfig(enabled=True))
    found = []
    for e in events:
        verdict = detector.update(e)
        if verdict.is_anomaly and verdict.type.value in ("instability_warning", "lr_too_high"):
            found.append(e.step)
    return found


class Judged(NamedTuple):
    first: int | None  # first warning at or after onset - HORIZON
    false: int  # warnings before that (all of them on a healthy run)


def episodes(alarms: list[int]) -> list[int]:
    """The first step of each run of consecutive alarmed steps: one warning each."""
    return [s for i, s in enumerate(alarms) if i == 0 or alarms[i - 1] != s - 1]


def judge(alarms: list[int], onset: int | None) -> Judged:
    alarms = episodes(alarms)
    if onset is None:
        return Judged(None, len(alarms))
    early = [s for s in alarms if s < onset - HORIZON]
    late = [s for s in alarms if s >= onset - HORIZON]
    return Judged(late[0] if late else None, len(early))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--onset", type=int, default=500)
    parser.add_argument("--tasks", default="mlp,lm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)  # observe mode narrates what it would do; the figures say it
    settings = load_settings({}, env={})
    forest = load_settings({"ml.forest": True}, env={})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for task_name in args.tasks.split(","):
            for kind in HEALTHY + FAULTS:
                events = record(task_name, kind, args.steps, args.onset, tmp)
                onset = None if kind.startswith("healthy") else args.onset
                decided = [d for d in backtest_events(events, settings) if d.is_anomaly]
                loss_first = judge(sorted({d.step for d in decided}), onset)
                row = {
                    "task": task_name,
                    "run": kind,
                    "steps": len(events),
                    "loss_alarm": loss_first.first,
                    "loss_false": loss_first.false,
                    "loss_alarm_type": next(
                        (d.type.value for d in decided if d.step == loss_first.first), None
                    ),
                }
                bare = without_update(events)
                for name, alarms in (
                    ("update", update_alarms(events)),
                    ("update_per_lr", update_alarms(events, per_lr=True)),
                    ("predictor", predictor_alarms(events)),
                    ("predictor_no_update", predictor_alarms(bare)),
                    ("forest", pipeline_alarms(events, forest)),
                    ("forest_no_update", pipeline_alarms(bare, forest)),
                ):
                    j = judge(alarms, onset)
                    end = loss_first.first if loss_first.first is not None else len(events)
                    row[name] = {
                        "first": j.first,
                        "false": j.false,
                        "lead": None if j.first is None else end - j.first,
                    }
                rows.append(row)
                if not args.json:
                    print(json.dumps(row))
    summary = {}
    for name in SIGNALS:
        faults = [r for r in rows if r["run"] in FAULTS]
        leads = [r[name]["lead"] for r in faults if r[name]["lead"] is not None]
        healthy = [r for r in rows if r["run"] in HEALTHY]
        summary[name] = {
            "warned": f"{len(leads)}/{len(faults)}",
            "warned_first": sum(1 for x in leads if x > 0),
            "median_lead": statistics.median(leads) if leads else None,
            "leads": {f"{r['task']}/{r['run']}": r[name]["lead"] for r in faults},
            "false_on_healthy": sum(r[name]["false"] for r in healthy),
            "healthy_steps": sum(r["steps"] for r in healthy),
            "false_before_onset_on_faults": sum(r[name]["false"] for r in faults),
        }
    summary["loss_alarm"] = {
        f"{r['task']}/{r['run']}": r["loss_alarm"] for r in rows if r["run"] in FAULTS
    }
    summary["loss_false_on_healthy"] = sum(r["loss_false"] for r in rows if r["run"] in HEALTHY)
    report = {
        "date": "2026-12-01",
        "steps": args.steps,
        "onset": args.onset,
        "horizon": HORIZON,
        "summary": summary,
        "runs": rows,
    }
    print(json.dumps(report if args.json else summary, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
