"""The anchors' recovery strategies, each as its authors describe it, on one plain training loop.

=================  =============================================================
``none``            nothing.
``olmo_skip_step``  OLMo's skip-step rule: skip the update when the loss or the
                    gradient norm is more than 6 sigma above the mean of the last
                    128 steps (judged once 64 are known; every finite value is
                    recorded, spikes included, as OLMo does).
``zclip``           ZClip (zscore mode, adaptive scaling): EMA (alpha 0.97) mean
                    and variance of the gradient norm after 25 warm-up steps; a
                    norm with z > 2.5 is clipped to mean + (2.5 / z) * std, and
                    the EMA learns the clipped norm.
``lightning_spike`` Lightning's ``SpikeDetection`` with its defaults (window 10,
                    rtol 2.0, non-finite is a spike), automated: on a spike the
                    current and previous batch go to the skip list and the run
                    restarts from its newest checkpoint with a fresh detector
                    (at most ``max_restarts`` times).
``palm_manual``     PaLM's recipe: a loss 25 % above the mean of the last 50 steps
                    (or non-finite) is a spike; restart from the newest
                    checkpoint at least ``palm_back`` steps before it and skip
                    ``palm_skip`` batches from there, or up to the spike's
                    batch if that is further (at most
                    ``palm_max_restarts`` times: then the run goes on as is).
=================  =============================================================

Checkpoints (every ``checkpoint_every`` steps) are kept in memory: the
benchmark measures what a strategy does to the run, not disk speed.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from recovery_faults import Fault
from recovery_ledger import Ledger, grad_norm
from recovery_setup import BenchConfig, Problem, evaluate, lm_loss
from spikeguard.producers.data import GuardedLoader

BASELINES = ("none", "olmo_skip_step", "zclip", "lightning_spike", "palm_manual")
# Strategies that change nothing until their rule fires (a restart): until then their run is
# the none run, update for update. A rule that never fires on the none run's own trace
# leaves the run the none run's (see never_fires).
RESTART_ONLY = ("lightning_spike", "palm_manual")
UPDATE, SKIP = "update", "skip"


@dataclass
class Restart:
    """Go back to the checkpoint at ``step`` (the newest at or before it) and skip ``skip`` batches."""

    before: int
    skip: tuple[int, int] | None
    why: str
    more_skips: tuple[tuple[int, int], ...] = ()  # further windows to skip from there


@dataclass
class SkipAhead:
    """Skip these windows of batches ahead, and apply this step's update."""

    windows: tuple[tuple[int, int], ...]


class NoStrategy:
    def judge(self, step: int, index: int, loss: float, norm: float, grads: list) -> Any:
        return UPDATE

    def restarted(self) -> None:
        pass

    def checkpoints_at(self, step: int) -> bool:
        """Whether to checkpoint after ``step`` besides the common cadence."""
        return False


class SamePath(NoStrategy):
    """Another run's data path, replayed without its judgement: its rollbacks (decided at the
    same steps, back to the same steps), its skip windows and its skipped updates.

    ``path`` is the ``path`` of a run's summary (recovery_ledger.Ledger). Replaying a guarded
    run's path in the plain loop tells what that path costs by itself: when the guarded run
    applied nothing else (no LR or clipping change), the two runs are the same run, so the
    guarded run's difference to ``none`` is its decisions' and not the Guard's presence.
    """

    def __init__(self, path: dict) -> None:
        self.pending = [dict(e) for e in path["rollbacks"]]
        self.skipped_updates = set(path["skipped_updates"])
        self.targets = {e["to"] for e in self.pending if e["to"] is not None}

    def checkpoints_at(self, step: int) -> bool:
        return step in self.targets

    def judge(self, step: int, index: int, loss: float, norm: float, grads: list) -> Any:
        if self.pending and self.pending[0]["at"] == step:
            event = self.pending.pop(0)
            windows = tuple((int(a), int(b)) for a, b in event["skip"])
            if event["to"] is None:
                return SkipAhead(windows)
            return Restart(event["to"], None, "the replayed path's rollback", windows)
        # A pass a later rollback throws away is not the final timeline's: it updates as usual.
        final = all(e["to"] is None or e["to"] > step for e in self.pending)
        return SKIP if final and step in self.skipped_updates else UPDATE


class OlmoSkipStep(NoStrategy):
    def __init__(self, window: int = 128, sigma: float = 6.0) -> None:
        self.sigma, self.min_history = sigma, window // 2
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)

    @staticmethod
    def _above(value: float, history: deque, sigma: float) -> bool:
        t = torch.tensor(list(history))
        return not value - float(t.mean()) <= sigma * float(t.std())  # NaN compares False: skipped

    def judge(self, step: int, index: int, loss: float, norm: float, grads: list) -> Any:
        skip = len(self.losses) >= self.min_history and (
            self._above(loss, self.losses, self.sigma) or self._above(norm, self.norms, self.sigma)
        )
        if math.isfinite(loss) and math.isfinite(norm):
            self.losses.append(loss)
            self.norms.append(norm)
        return SKIP if skip else UPDATE


class ZClip(NoStrategy):
    def __init__(
        self, alpha: float = 0.97, z: float = 2.5, warmup: int = 25, eps: float = 1e-6
    ) -> None:
        self.alpha, self.z, self.warmup, self.eps = alpha, z, warmup, eps
        self.buffer: list[float] = []
        self.mean: float | None = None
        self.var = 0.0
        self.clipped = 0

    def judge(self, step: int, index: int, loss: float, norm: float, grads: list) -> Any:
        if not math.isfinite(norm):
            return UPDATE  # ZClip clips, it does not skip: a non-finite gradient goes through
        if self.mean is None:
            self.buffer.append(norm)
            if len(self.buffer) == self.warmup:
                t = torch.tensor(self.buffer)
                self.mean, self.var = float(t.mean()), float(t.var(unbiased=False))
            return UPDATE
        std = math.sqrt(self.var)
        z = (norm - self.mean) / (std + self.eps)
        if z > self.z:
            target = self.mean + (self.z / z) * std
            torch._foreach_mul_(grads, target / (norm + self.eps))
            norm = target
            self.clipped += 1
        self.mean = self.alpha * self.mean + (1 - self.alpha) * norm
        self.var = self.alpha * self.var + (1 - self.alpha) * (norm - self.mean) ** 2
        return UPDATE


class LightningSpike(NoStrategy):
    def __init__(self, window: int = 10, rtol: float = 2.0, warmup: int = 1) -> None:
        self.window, self.rtol, self.warmup = window, rtol, warmup
        self.bad: list[int] = []  # the skip file: kept across restarts
        self.restarted()

    def restarted(self) -> None:
        self.values: deque[float] = deque(maxlen=self.window)
        self.last, self.seen = 0.0, 0
        self.previous: int | None = None  # the batch index of the step before

    def judge(self, step: int, index: int, loss: float, norm: float, grads: list) -> Any:
        seen, previous = self.seen, self.previous
        self.seen, self.previous = seen + 1, index
        if seen >= self.warmup:
            spike = not math.isfinite(loss)
            if not spike and loss > self.last and self.values:
                mean = sum(self.values) / len(self.values)
                spike = abs(loss - mean) >= abs(self.rtol * mean)
            if spike:
                first = previous if previous is not None else index
                self.bad += [first, index]
                return Restart(
                    step, (first, index), f"spike at step {step} (batch {index}, loss {loss:.3g})"
                )
        if math.isfinite(loss):
            self.values.append(loss)
            self.last = loss
        return UPDATE


class PalmManual(NoStrategy):
    def __init__(self, back: int, skip: int, window: int = 50, ratio: float = 1.25) -> None:
        self.back, self.skip, self.ratio = back, skip, ratio
        self.window = window
        self.restarted()

    def restarted(self) -> None:
        self.values: deque[float] = deque(maxlen=self.window)

    def judge(self, step: int, index: int, loss: float, norm: float, grads: list) -> Any:
        full = len(self.values) >= self.window // 2
        if not math.isfinite(loss) or (
            full and loss > self.ratio * sum(self.values) / len(self.values)
        ):
            return Restart(
                step - self.back, None, f"spike at step {step} (batch {index}, loss {loss:.3g})"
            )
        self.values.append(loss)
        return UPDATE


def never_fires(strategy: str, cfg: BenchConfig, trace: list[list[float]]) -> bool:
    """Whether ``strategy``'s rule (one of RESTART_ONLY) stays silent on the none run's trace
    of ``[step, batch index, loss, gradient norm]``: then its run is that run, exactly (it
    judges the same numbers, and until a restart it neither skips nor touches a gradient)."""
    if strategy not in RESTART_ONLY:
        raise ValueError(f"{strategy} acts on every step; only {RESTART_ONLY} can be replayed")
    rule = make(strategy, cfg)
    return not any(
        isinstance(rule.judge(int(step), int(index), loss, norm, []), Restart)
        for step, index, loss, norm in trace
    )


def make(strategy: str, cfg: BenchConfig) -> NoStrategy:
    if strategy == "none":
        return NoStrategy()
    if strategy == "olmo_skip_step":
        return OlmoSkipStep()
    if strategy == "zclip":
        return ZClip()
    if strategy == "lightning_spike":
        return LightningSpike()
    if strategy == "palm_manual":
        return PalmManual(cfg.palm_back, cfg.palm_skip)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(BASELINES)}")


def _capture(p: Problem, scaler: Any, loader: GuardedLoader, step: int) -> dict:
    return copy.deepcopy(
        {
            "model": p.model.state_dict(),
            "optimizer": p.optimizer.state_dict(),
            "scheduler": p.scheduler.state_dict(),
            "position": loader.position,
            "step": step,
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
    )


def _restore(p: Problem, scaler: Any, loader: GuardedLoader, body: dict) -> int:
    body = copy.deepcopy(body)
    p.model.load_state_dict(body["model"])
    p.optimizer.load_state_dict(body["optimizer"])
    p.scheduler.load_state_dict(body["scheduler"])
    if scaler is not None:
        scaler.load_state_dict(body["scaler"])
    loader.seek(body["position"])
    return body["step"]


def run_baseline(
    problem: Problem,
    fault: Fault,
    strategy: str,
    cfg: BenchConfig,
    seed: int,
    rule: NoStrategy | None = None,
) -> dict:
    """``rule``: judge with this instead of ``strategy``'s own (``strategy`` names the run)."""
    started = time.monotonic()
    rule = make(strategy, cfg) if rule is None else rule
    p, ledger = problem, Ledger(cfg.steps)
    ledger.watch(p.optimizer)
    scaler = fault.make_scaler()
    loader = GuardedLoader(
        p.loader, seed=seed
    )  # the guard's order: every strategy sees the same batches
    checkpoints = {0: _capture(p, scaler, loader, 0)}
    limit = cfg.palm_max_restarts if strategy == "palm_manual" else cfg.max_restarts
    trace: list[list[float]] = []  # the none run's [step, batch, loss, norm]: see never_fires
    step = 0
    while step < cfg.steps:
        for x, y in loader:
            index = loader.last_index
            assert index is not None  # set by the batch just read
            x, y = fault.batch(index, x, y)
            p.optimizer.zero_grad(set_to_none=True)
            loss = fault.loss(index, lm_loss(p.model, x, y))
            (scaler.scale(loss) if scaler is not None else loss).backward()
            fault.grads(index, p.model)
            if scaler is not None:
                scaler.unscale_(p.optimizer)
            ledger.begin()
            grads = [q.grad for q in p.model.parameters() if q.grad is not None]
            values = torch.stack([loss.detach().float(), grad_norm(p.model)]).tolist()
            verdict = rule.judge(step, index, values[0], values[1], grads)
            if strategy == "none":
                trace.append([step, index, values[0], values[1]])
            if isinstance(verdict, Restart) and ledger.rollbacks < limit:
                target = max(s for s in checkpoints if s <= max(0, verdict.before))
                if scaler is not None:
                    scaler.update()  # close this step's unscale_ before the scaler state is replaced
                decided, windows = step, [list(w) for w in loader.skip_ranges]
                step = _restore(p, scaler, loader, checkpoints[target])
                for s in [s for s in checkpoints if s > target]:
                    del checkpoints[s]  # a restart's timeline overwrites them
                for window in verdict.more_skips:
                    loader.skip(*window)
                if verdict.skip is not None:
                    loader.skip(*verdict.skip)
                elif (
                    strategy == "palm_manual"
                ):  # the batches before and during the spike, at least palm_skip
                    loader.skip(loader.position, max(loader.position + cfg.palm_skip - 1, index))
                rule.restarted()
                ledger.rolled_back(
                    step,
                    f"{verdict.why}: restart at step {step}, skips {loader.skip_ranges}",
                    at=decided,
                )
                new = [list(w) for w in loader.skip_ranges if list(w) not in windows]
                if new:
                    ledger.skips_set(decided, new, with_rollback=True)
                continue
            if isinstance(verdict, SkipAhead):
                windows = [list(w) for w in loader.skip_ranges]
                for window in verdict.windows:
                    loader.skip(*window)
                new = [list(w) for w in loader.skip_ranges if list(w) not in windows]
                if new:
                    ledger.skips_set(step, new, with_rollback=False)
                verdict = UPDATE
            if verdict == SKIP:
                if scaler is not None:
                    scaler.update()
                ledger.events.append(f"skipped update at step {step}")
            elif scaler is not None:
                scaler.step(p.optimizer)
                scaler.update()
            else:
                p.optimizer.step()
            p.scheduler.step()
            ledger.done(step)
            step += 1
            if step % cfg.checkpoint_every == 0 or rule.checkpoints_at(step):
                checkpoints[step] = _capture(p, scaler, loader, step)
            if step >= cfg.steps:
                break
    result = ledger.summary(
        fault.name,
        strategy,
        evaluate(p),
        loader.skip_ranges,
        loader.position,
        time.monotonic() - started,
    )
    if strategy == "none":
        result["trace"] = trace
    return result
