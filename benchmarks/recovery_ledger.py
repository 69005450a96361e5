"""What one benchmark run cost: the same bookkeeping for every strategy, spikeguard included.

``wasted_steps`` = re-run steps + skipped batches, counted the same way for all:

- re-run: every forward/backward pass beyond the budget, i.e. steps whose
  work a rollback threw away (including the pass at which it was decided);
- skipped updates: steps of the final timeline whose update was not applied
  (a skip rule, a non-finite guard, a GradScaler overflow);
- skipped batches: batches a skip list jumped over, up to where the run
  stopped reading (a skip range reaching past the end costs nothing).

Goodput (after Google's ml-goodput-measurement: badput is "disruptions and
the progress they wasted"): ``goodput`` = steps kept whose update was
applied / forward-backward passes run; the badput is itemised as
``rerun_steps``, ``skipped_updates``, ``skipped_batches`` and
``recovery_seconds`` (wall time of the passes a rollback threw away).

A run that a strategy stopped before the budget (spikeguard's STOP) is not
charged for the steps it never ran: ``steps_done`` says where it ended, and
its eval loss is that of the stopped model, which is what its user has.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Ledger:
    budget: int
    executed: int = 0
    rollbacks: int = 0
    timeline: dict[int, bool] = field(default_factory=dict)  # step -> update applied
    events: list[str] = field(default_factory=list)  # what the strategy did, for the diagnosis
    seconds: dict[int, float] = field(default_factory=dict)  # step -> wall time of its kept pass
    recovery_seconds: float = 0.0  # wall time of passes a rollback threw away
    # The data path, in order, for recovery_baselines.SamePath: rollbacks ({"at": the step whose
    # pass decided it, "to": the step it went back to, "skip": windows set with it}) and skip
    # windows set without one ("to": None).
    path: list[dict] = field(default_factory=list)
    _updated: bool = False
    _began: float = 0.0

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Count real optimizer updates (a GradScaler that skips never calls ``optimizer.step``)."""

        def hook(*_: Any) -> None:
            self._updated = True

        optimizer.register_step_post_hook(hook)

    def begin(self) -> None:
        self._updated = False
        self.executed += 1
        self._began = time.perf_counter()

    def done(self, step: int) -> None:
        self.timeline[step] = self._updated
        self.seconds[step] = time.perf_counter() - self._began

    def rolled_back(self, to_step: int, note: str, at: int | None = None) -> None:
        """``at``: the step whose pass decided it, to keep it in ``path``."""
        if at is not None:
            self.path.append({"at": at, "to": to_step, "skip": []})
        self.rollbacks += 1
        self.recovery_seconds += time.perf_counter() - self._began  # the pass that decided it
        for s in [s for s in self.timeline if s >= to_step]:
            del self.timeline[s]
            self.recovery_seconds += self.seconds.pop(s, 0.0)
        self.events.append(note)

    def skips_set(self, at: int, windows: list[list[int]], with_rollback: bool) -> None:
        """Skip windows set by the pass of step ``at`` (by the rollback it decided, or ahead)."""
        if with_rollback:
            self.path[-1]["skip"] += windows
        else:
            self.path.append({"at": at, "to": None, "skip": windows})

    def summary(
        self,
        fault: str,
        strategy: str,
        eval_loss: float,
        skip_ranges: list,
        position: int,
        seconds: float,
    ) -> dict[str, Any]:
        jumped = sum(max(0, min(int(b), position - 1) - int(a) + 1) for a, b in skip_ranges)
        done = len(self.timeline)
        skipped_updates = sum(1 for applied in self.timeline.values() if not applied)
        rerun = max(0, self.executed - done)
        goodput = (done - skipped_updates) / self.executed if self.executed else 0.0
        return {
            "fault": fault,
            "strategy": strategy,
            "final_eval_loss": eval_loss,
            "wasted_steps": rerun + skipped_updates + jumped,
            "rollbacks": self.rollbacks,
            "goodput": round(goodput, 4),
            "recovery_seconds": round(self.recovery_seconds, 2),
            "rerun_steps": rerun,
            "skipped_updates": skipped_updates,
            "skipped_batches": jumped,
            "steps_done": done,
            "seconds": round(seconds, 1),
            "events": self.events,
            "path": {
                "rollbacks": self.path,
                "skipped_updates": sorted(s for s, applied in self.timeline.items() if not applied),
            },
        }


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def finite(value: float) -> bool:
    return math.isfinite(value)
