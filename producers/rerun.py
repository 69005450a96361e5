"""Re-run a suspicious step once, to tell a flaky device from bad data.

A step that came out non-finite or extreme is computed a second time from
the same state: the same parameters (the update was not applied yet), the
same batch (the user's ``closure`` recomputes it, as ``optimizer.step(closure)``
does) and the same random streams (captured before the step, so dropout
draws the same masks). Deterministic arithmetic on the same inputs gives the
same answer, so:

- **reproducible**: the rerun agrees (both non-finite, or loss and gradient
  norm within ``tolerance``): the data or the optimisation did it, and the
  usual policy applies;
- **transient**: the rerun differs: suspect the hardware (Megatron's rerun
  state machine draws the same line) and count it against the device, with no
  rollback. The rerun recomputed the same batch on the same weights, so when
  its own values are clean (finite, not an outlier to the Guard's skip rule)
  its gradient is the step's true one and the Guard applies it; a rerun that
  is itself suspicious leaves the update skipped.

``tolerance`` is relative (default 1e-2): GPU kernels with non-deterministic
reductions move a loss by ~1e-6 relative, bf16 by ~1e-3; a bit flip that
made a step extreme moves it by orders of magnitude. It was chosen on that
reasoning, not on data. Off by default: it costs one extra forward and
backward on each suspicious step, and an RNG capture on every step.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Literal

import torch

from spikeguard.producers import rng

Verdict = Literal["transient", "reproducible"]
Closure = Callable[[], torch.Tensor]  # recomputes the loss and calls backward; returns the loss


def _differ(a: float, b: float, tolerance: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.isfinite(a) != math.isfinite(b)
    return abs(a - b) > tolerance * max(abs(a), abs(b), 1e-12)


class RerunCheck:
    """Captures the random streams before each step; re-runs one step on request."""

    def __init__(self, reruns: int = 0, tolerance: float = 1e-2) -> None:
        if reruns not in (0, 1):
            raise ValueError(f"verify_reruns must be 0 (off) or 1, got {reruns}")
        self.enabled = reruns == 1
        self.tolerance = tolerance
        self._rng: dict | None = None
        self.counts = {"transient": 0, "reproducible": 0}
        self.last: tuple[float, float | None] | None = (
            None  # the last re-run's loss and gradient norm
        )

    def before_step(self) -> None:
        """Called when the previous step is done: what the next forward pass will draw from."""
        if self.enabled:
            self._rng = rng.capture()

    def verify(
        self,
        closure: Closure,
        params: list[torch.nn.Parameter],
        first_loss: float,
        first_norm: float | None,
    ) -> Verdict | None:
        """Recompute the step; None when it cannot be (off, no closure, no captured state)."""
        if not self.enabled or closure is None or self._rng is None:
            return None
        after = rng.capture()  # the random streams go on as if the step had run once
        rng.restore(self._rng)
        for p in params:
            p.grad = None
        try:
            loss = float(closure().detach())
        finally:
            rng.restore(after)
        grads = [p.grad.detach().flatten() for p in params if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.cat([g.float() for g in grads])))
            if grads
            else None
        )
        self.last = (loss, norm)
        differs = _differ(first_loss, loss, self.tolerance) or (
            first_norm is not None
            and norm is not None
            and _differ(first_norm, norm, self.tolerance)
        )
        verdict: Verdict = "transient" if differs else "reproducible"
        self.counts[verdict] += 1
        return verdict

    def judge(
        self, closure: Closure | None, params: list[torch.nn.Parameter], stats: Any
    ) -> tuple[Any, Verdict | None]:
        """The Guard's use: ``(stats to publish, verdict)``. A transient step publishes the
        re-run's loss and norm (what the data really gives), so the pipeline does not act on a
        fault the device made; its per-layer norms are unknown (the first run's were the fault's)."""
        verdict = (
            self.verify(closure, params, stats.loss, stats.grad_norm)
            if closure is not None
            else None
        )
        if verdict == "transient" and self.last is not None:
            loss, norm = self.last
            stats = replace(stats, loss=loss, grad_norm=norm, top={}, nonfinite_grads=0)
        return stats, verdict
