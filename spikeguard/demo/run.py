"""One demo training, with or without the guard, and what came of it.

The guarded run goes through the whole pipeline (detectors, fusion, policy)
on the runtime's bus in lockstep mode, so one seed gives one result; the
unguarded run is the same loop with the same data order and no guard.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from spikeguard.producers.config import GuardConfig
from spikeguard.producers.data import GuardedLoader
from spikeguard.demo.model import (
    DemoSetup,
    Problem,
    blow_up_lr,
    build,
    evaluate,
    inject,
    plant_poison,
)
from spikeguard.producers.guard import Guard
from spikeguard.schemas import Decision, decode

Progress = Callable[[int, int, float], None]

# The policy's defaults are sized for runs of many thousand steps; the demo has 300.
DEMO_SETTINGS = {
    "policy.rollback_min_steps_before_onset": 20,
    "policy.lr_restore_healthy_steps": 10,
    "policy.lr_restore_factor": 1.5,
    "policy.clip_mode": "adaptive",
    "policy.divergence_step_interval_steps": 10,
    "policy.preventive_min_interval_steps": 50,
}


@dataclass
class DemoOutcome:
    fault: str
    guarded: bool
    seed: int
    steps: int
    final_eval_loss: float
    incidents: int = 0
    rollbacks: int = 0
    skipped_batches: int = 0
    skipped_updates: int = 0
    nonfinite_updates: int = 0  # optimizer updates applied with a non-finite gradient
    actions_applied: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    losses: list[tuple[int, int, float]] = field(
        default_factory=list
    )  # (step, rollback generation, loss)
    detections: list[tuple[int, int, str]] = field(
        default_factory=list
    )  # (step, rollback generation, type)
    actions: list[dict] = field(default_factory=list)
    transient_steps: int = 0  # steps a re-run found different (the ``flaky`` fault)
    planted: list[int] = field(default_factory=list)  # the ``poison`` fault's sample ids
    incident_files: list[str] = field(default_factory=list)  # for ``spikeguard inspect``

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        for bulky in ("losses", "detections", "actions"):
            out.pop(bulky)
        return out


def _count_nonfinite_updates(optimizer: torch.optim.Optimizer, tally: Counter) -> None:
    def hook(opt: torch.optim.Optimizer, *_: Any) -> None:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if grads and not all(bool(torch.isfinite(g).all()) for g in grads):
            tally["nonfinite"] += 1

    optimizer.register_step_pre_hook(hook)


def _train_step(problem: Problem, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    problem.optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(problem.model(x), y)
    loss.backward()
    return loss


def run_demo(
    fault: str = "spike",
    seed: int = 0,
    guarded: bool = True,
    setup: DemoSetup | None = None,
    runtime: Any = None,
    progress: Progress | None = None,
    config: GuardConfig | None = None,
    keep_incidents: str | None = None,
) -> DemoOutcome:
    """``keep_incidents``: a directory to copy the Guard's incident records (forensics) into."""
    setup = setup or DemoSetup()
    torch.set_num_threads(1)
    problem = build(seed, setup)
    planted = plant_poison(problem, seed, setup) if fault == "poison" else []
    tally: Counter = Counter()
    _count_nonfinite_updates(problem.optimizer, tally)
    started = time.monotonic()
    if guarded:
        outcome = _guarded(
            problem, fault, seed, setup, runtime, progress, tally, config, keep_incidents
        )
    else:
        outcome = _unguarded(problem, fault, seed, setup, progress, tally)
    outcome.planted = planted
    outcome.final_eval_loss = evaluate(problem)
    outcome.nonfinite_updates = tally["nonfinite"]
    outcome.seconds = round(time.monotonic() - started, 2)
    return outcome


def _unguarded(
    problem: Problem,
    fault: str,
    seed: int,
    setup: DemoSetup,
    progress: Progress | None,
    tally: Counter,
) -> DemoOutcome:
    outcome = DemoOutcome(fault, False, seed, 0, math.nan)
    loader = GuardedLoader(problem.loader, seed=seed)  # the same deterministic order as the guard's
    step = 0
    while step < setup.steps:
        for x, y in loader:
            if fault == "divergence" and step == setup.fault_step:
                blow_up_lr(problem, setup.lr_blowup)
            loss = _train_step(
                problem,
                _flaky(inject(fault, loader.last_index, x, setup), fault, step, setup, set()),
                y,
            )
            problem.optimizer.step()
            problem.scheduler.step()
            outcome.losses.append((step, 0, float(loss.detach())))
            step += 1
            if progress:
                progress(step, setup.steps, float(loss.detach()))
            if step >= setup.steps:
                break
    outcome.steps = step
    return outcome


def _flaky(
    x: torch.Tensor, fault: str, step: int, setup: DemoSetup, struck: set[int]
) -> torch.Tensor:
    """The ``flaky`` fault: the device corrupts the first computation of each fault step, once."""
    if (
        fault != "flaky"
        or not setup.fault_step <= step < setup.fault_step + setup.fault_batches
        or step in struck
    ):
        return x
    struck.add(step)
    return x * float("nan")


def _recompute(problem: Problem, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The step's loss and gradients again (the Guard's re-run; it cleared the gradients)."""
    loss = nn.functional.cross_entropy(problem.model(x), y)
    loss.backward()
    return loss


def _guarded(
    problem: Problem,
    fault: str,
    seed: int,
    setup: DemoSetup,
    runtime: Any,
    progress: Progress | None,
    tally: Counter,
    config: GuardConfig | None,
    keep_incidents: str | None = None,
) -> DemoOutcome:
    outcome = DemoOutcome(fault, True, seed, 0, math.nan)
    owned = runtime is None
    if owned:
        from spikeguard.runtime import open_runtime
        from spikeguard.settings import load_settings

        runtime = open_runtime(load_settings(DEMO_SETTINGS))
    if runtime.bus is None:  # a demo of the pipeline without one would show nothing
        from spikeguard.errors import BusError

        raise BusError(f"the demo needs its pipeline: {runtime.problem}")
    workdir = tempfile.mkdtemp(prefix="spikeguard-demo-")
    run_id = f"demo-{fault}-{seed}-{int(time.time() * 1000) % 10**9}"
    cfg = config or GuardConfig(
        checkpoint_dir=workdir,
        checkpoint_every=20,
        keep_checkpoints=4,
        resume=False,
        lockstep=True,
        data_seed=seed,
        healthy_stretch=10,
        verify_reruns=1,
    )  # a suspicious step is re-run once: flaky or data?
    # The run names the policy its pipeline applies, so the Guard checks its checkpoint
    # cadence against it (and publishes it on the runs topic) rather than the defaults.
    policy = runtime.settings.policy.model_dump(mode="json", exclude_defaults=True)
    guard = Guard(
        problem.model,
        problem.optimizer,
        problem.scheduler,
        run_id=run_id,
        runtime=runtime,  # its pipeline's key: the demo trainer obeys only actions signed with it
        config=cfg,
        policy=policy,
    )
    blown = False
    struck: set[int] = set()  # flaky fault steps already corrupted once
    try:
        data = guard.data(problem.loader, max_steps=setup.steps)
        while guard.step_count < setup.steps and not guard.should_stop:
            for x, y in data:
                if fault == "divergence" and guard.step_count == setup.fault_step and not blown:
                    blow_up_lr(problem, setup.lr_blowup)  # once: a rollback undoes it
                    blown = True
                step, generation = guard.step_count, guard.generation
                x = inject(fault, data.last_index, x, setup)
                loss = _train_step(problem, _flaky(x, fault, step, setup, struck), y)
                guard.step(loss, closure=partial(_recompute, problem, x, y))
                outcome.losses.append((step, generation, float(loss.detach())))
                if progress:
                    progress(guard.step_count, setup.steps, float(loss.detach()))
    finally:
        guard.close()
        decisions = [
            decode(r.value, Decision) for r in runtime.bus.read_all(runtime.topics.decisions)
        ]
        if owned:
            runtime.close()
        incidents = Path(workdir) / "incidents"
        if keep_incidents and incidents.is_dir():
            shutil.copytree(incidents, keep_incidents, dirs_exist_ok=True)
            outcome.incident_files = sorted(
                str(Path(keep_incidents) / f.name) for f in incidents.glob("*.json")
            )
        shutil.rmtree(workdir, ignore_errors=True)
    mine = [d for d in decisions if d.run_id == run_id and d.is_anomaly and not d.preventive]
    outcome.detections = [(d.step, d.epoch, d.type.value) for d in mine]
    outcome.incidents = len({d.incident_id or d.decision_id for d in mine})
    outcome.steps = guard.step_count
    outcome.rollbacks = guard.counters["rollbacks"]
    outcome.skipped_updates = guard.counters["skipped_updates"]
    outcome.transient_steps = guard.counters["transient_steps"]
    ranges = guard.loader.skip_ranges if guard.loader is not None else []
    outcome.skipped_batches = sum(b - a + 1 for a, b in ranges)
    outcome.actions = list(guard.applied)
    outcome.actions_applied = dict(
        Counter(a["kind"] for a in guard.applied if a["status"] == "applied")
    )
    return outcome
