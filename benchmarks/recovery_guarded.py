"""The ``spikeguard`` strategy: the same loop as the baselines, guarded through the public Guard API.

The whole pipeline (detectors, fusion, policy, actuator) runs embedded, in
lockstep (each step is decided before the next one starts), so one seed gives
one result. The policy settings are the demo's, sized for runs of hundreds of
steps rather than the many thousands the defaults assume; nothing else is
tuned for the benchmark. Every applied action and every anomalous decision is
kept in the run's ``events`` so that a loss can be traced to what was decided.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any

from recovery_faults import Fault
from recovery_ledger import Ledger
from recovery_setup import BenchConfig, Problem, evaluate, lm_loss
from spikeguard.demo.run import DEMO_SETTINGS
from spikeguard.producers.config import GuardConfig
from spikeguard.producers.guard import Guard
from spikeguard.schemas import Action, Decision, decode


def open_bench_runtime() -> Any:
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    return open_runtime(load_settings(DEMO_SETTINGS))


def _keep_checkpoints(every: int, runtime: Any) -> int:
    """Four checkpoints, or as many as the pipeline's rollback distance needs at this cadence:
    ``(keep - 1) * every`` must reach the policy's distance before the onset plus the detection
    delay (run_plan.py refuses less)."""
    reach = (
        runtime.settings.policy.rollback_min_steps_before_onset
        + GuardConfig().detection_delay_steps
    )
    return max(4, -(-reach // every) + 1)


def run_spikeguard(
    problem: Problem,
    fault: Fault,
    cfg: BenchConfig,
    seed: int,
    runtime: Any,
    signals: bool = False,
) -> dict:
    """``signals``: the trainer opts in to the mechanism signals (producers/signals/prevention.py)."""
    started = time.monotonic()
    p, ledger = problem, Ledger(cfg.steps)
    ledger.watch(p.optimizer)
    scaler = fault.make_scaler()
    workdir = tempfile.mkdtemp(prefix="spikeguard-bench-")
    run_id = f"bench-{fault.name}-{seed}-{time.monotonic_ns() % 10**9}"
    # verify_reruns=1: a suspicious step is re-run once (the demo's setting), so a transient
    # device fault is told from a bad batch.
    policy = runtime.settings.policy.model_dump(mode="json", exclude_defaults=True)
    config = GuardConfig(
        checkpoint_dir=workdir,
        checkpoint_every=cfg.checkpoint_every,
        keep_checkpoints=_keep_checkpoints(cfg.checkpoint_every, runtime),
        resume=False,
        lockstep=True,
        data_seed=seed,
        healthy_stretch=10,
        verify_reruns=0 if scaler is not None else 1,
    )
    guard = Guard(
        p.model,
        p.optimizer,
        p.scheduler,
        run_id=run_id,
        config=config,
        runtime=runtime,
        scaler=scaler,
        # the policy its pipeline applies (DEMO_SETTINGS): the Guard checks its checkpoint
        # cadence against that one, not the defaults
        policy=policy,
    )
    prevention = _opt_in(guard, p.model, cfg) if signals else None
    try:
        data = guard.data(p.loader, max_steps=cfg.steps)
        windows: list[list[int]] = []  # the skip windows set so far (for the ledger's path)
        while guard.step_count < cfg.steps and not guard.should_stop:
            for x, y in data:
                index, step, generation = data.last_index, guard.step_count, guard.generation
                x, y = fault.batch(index, x, y)
                p.optimizer.zero_grad(set_to_none=True)
                loss = fault.loss(index, lm_loss(p.model, x, y))
                (scaler.scale(loss) if scaler is not None else loss).backward()
                fault.grads(index, p.model)
                if scaler is not None:
                    scaler.unscale_(
                        p.optimizer
                    )  # the guard's statistics and clipping see true gradients
                ledger.begin()

                def again(
                    x=x, y=y, index=index
                ) -> Any:  # the Guard's re-run: same batch, fresh pass
                    redo = fault.loss(index, lm_loss(p.model, x, y))
                    redo.backward()
                    fault.grads(index, p.model)
                    return redo

                guard.step(loss, closure=again if scaler is None else None)
                rolled_back = guard.generation != generation
                if rolled_back:
                    ledger.rolled_back(
                        guard.step_count,
                        f"rollback decided at step {step}: back to step {guard.step_count}",
                        at=step,
                    )
                new_windows = [list(w) for w in data.skip_ranges if list(w) not in windows]
                if new_windows:
                    ledger.skips_set(step, new_windows, with_rollback=rolled_back)
                windows = [list(w) for w in data.skip_ranges]
                if rolled_back:
                    if scaler is not None and _unscaled(scaler):
                        scaler.update()  # the guard voided this step without closing the scaler's step
                else:
                    ledger.done(step)
    finally:
        guard.close()
        if prevention is not None:
            prevention.signals.close()
        decisions = [
            decode(r.value, Decision) for r in runtime.bus.read_all(runtime.topics.decisions)
        ]
        actions = [decode(r.value, Action) for r in runtime.bus.read_all(runtime.topics.actions)]
        shutil.rmtree(workdir, ignore_errors=True)
    for d in decisions:
        if d.run_id == run_id and d.is_anomaly:
            ledger.events.append(
                f"decision step {d.step} epoch {d.epoch}: {d.type.value} "
                f"(confidence {d.confidence:.2f}{', preventive' if d.preventive else ''})"
            )
    for a in actions:  # what the policy chose and why: its reason starts with the response
        if a.run_id == run_id:
            ledger.events.append(f"policy at step {a.apply_at_step}: {a.kind.value}: {a.reason}")
    for ack in guard.applied:
        ledger.events.append(
            f"action at step {ack['step']} epoch {ack['epoch']}: {ack['kind']} {ack['status']}: "
            f"{ack['result']}"
        )
    ranges = data.skip_ranges
    return ledger.summary(
        fault.name, "spikeguard", evaluate(p), ranges, data.position, time.monotonic() - started
    )


def _opt_in(guard: Guard, model: Any, cfg: BenchConfig) -> Any:
    from spikeguard.producers.signals import MechanismSignals, layer_groups
    from spikeguard.producers.signals.prevention import Prevention
    from spikeguard.producers.signals.qk_clip import fused_qk_heads

    blocks = list(model.blocks)
    probe = MechanismSignals(
        {str(i): b.qkv for i, b in enumerate(blocks)},
        layers=layer_groups(model, [f"blocks.{i}" for i in range(len(blocks))]),
        qkv_heads=cfg.heads,
    )
    return Prevention(guard, probe, fused_qk_heads(blocks))


def _unscaled(scaler: Any) -> bool:
    """Whether ``unscale_`` ran since the last ``update`` (then ``update`` must close it)."""
    states = getattr(scaler, "_per_optimizer_states", {})
    return any(s.get("found_inf_per_device") for s in states.values())
