"""The Guard's local skip-step rule: an isolated outlier step's update is skipped at once.

The pipeline is asynchronous: its verdict arrives after the update it judged
was applied. One kind of anomaly is cheap and urgent enough to handle in the
trainer itself: a single step whose loss (or gradient norm) jumps far above
the run's recent noise and would come straight back, the batch-induced
outlier OLMo-core skips. This module decides that, from the two numbers the
Guard already has on the host, in plain Python (no torch): the same rule runs
in a trainer, in a backtest and in a unit test, and gives the same answer on
the same sequence of ``(loss, grad_norm)``.

A step is an outlier when, for its loss or its gradient norm, both hold:

- it is ``z`` robust sigmas above the median of the last ``window`` *accepted*
  steps (sigma = 1.4826 x the median absolute deviation), and
- it is at least ``min_jump`` (relative) above that median: a run whose noise
  is tiny must not skip a 0.5 % wobble.

Outliers are kept out of the history (as axolotl's grad-norm guard and
metaseq do; OLMo-core does not, and a spike then inflates its own baseline).
A rule that never learned from outliers would skip for ever after a real level
shift, so only ``max_run`` outliers in a row are skipped; from the next one on
the rule stands aside (no skip) and learns every step for half a window, the
time its median needs to take in the new level. A long rise is an incident for
the pipeline to judge, not for this rule.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable

MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class SkipDecision:
    skip: bool
    #: "loss", "grad_norm", or both joined by "+": what was an outlier (empty: nothing).
    signal: str = ""
    loss_z: float | None = None
    grad_z: float | None = None


class RobustWindow:
    """The last ``size`` accepted values, kept sorted too, for a median and a MAD."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: deque[float] = deque()
        self.sorted: list[float] = []

    def __len__(self) -> int:
        return len(self.values)

    def add(self, value: float) -> None:
        self.values.append(value)
        insort(self.sorted, value)
        if len(self.values) > self.size:
            old = self.values.popleft()
            del self.sorted[bisect_left(self.sorted, old)]

    def median(self) -> float:
        s, n = self.sorted, len(self.sorted)
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])

    def mad(self, median: float) -> float:
        deviations = sorted(abs(v - median) for v in self.sorted)
        n = len(deviations)
        return deviations[n // 2] if n % 2 else 0.5 * (deviations[n // 2 - 1] + deviations[n // 2])

    def z(self, value: float, min_jump: float) -> float | None:
        """Robust z of ``value`` if it is above the median by at least ``min_jump``; else None.

        The MAD (a sort) is computed only past the cheap relative-jump test, so a
        normal step costs one insertion into the sorted window.
        """
        median = self.median()
        if not value > median + abs(median) * min_jump:
            return None
        sigma = MAD_TO_SIGMA * self.mad(median)
        floor = 1e-12 + 1e-6 * abs(median)  # a constant series has no noise: any jump is huge
        return (value - median) / max(sigma, floor)


class SkipRule:
    """Decide, step by step, whether an update is an isolated outlier to skip.

    >>> rule = SkipRule(min_history=4, window=8)
    >>> [rule.decide(loss, 1.0).skip for loss in (2.0, 2.01, 1.99, 2.0, 2.02, 2.6, 2.0)]
    [False, False, False, False, False, True, False]
    """

    def __init__(self, z: float = 6.0, min_jump: float = 0.05, grad_z: float = 6.0,
                 grad_min_jump: float = 2.0, window: int = 128, min_history: int = 32,
                 max_run: int = 2) -> None:
        if window < 3 or min_history < 3 or min_history > window:
            raise ValueError(f"need 3 <= min_history <= window, got min_history={min_history} "
                             f"window={window}")
        if z <= 0 or grad_z <= 0 or min_jump < 0 or grad_min_jump < 0 or max_run < 1:
            raise ValueError("z and grad_z must be > 0, min_jump and grad_min_jump >= 0, max_run >= 1")
        self.z = z
        self.min_jump = min_jump
        self.grad_z = grad_z
        self.grad_min_jump = grad_min_jump
        self.window = window
        self.min_history = min_history
        self.max_run = max_run
        self._loss = RobustWindow(window)
        self._grad = RobustWindow(window)
        self.run = 0  # consecutive outliers so far
        self.aside = 0  # steps left during which the rule learns everything and skips nothing

    def decide(self, loss: float, grad_norm: float | None = None) -> SkipDecision:
        """Judge one step, then learn it unless it is skipped. Non-finite values are not
        judged here (the Guard skips them on its own) and are never learned."""
        if not math.isfinite(loss):
            return SkipDecision(False)
        grad_ok = grad_norm is not None and math.isfinite(grad_norm)
        loss_z = self._loss.z(loss, self.min_jump) if len(self._loss) >= self.min_history else None
        grad_z = (self._grad.z(grad_norm, self.grad_min_jump)
                  if grad_ok and len(self._grad) >= self.min_history else None)
        hits = [name for name, value, limit in (("loss", loss_z, self.z), ("grad_norm", grad_z, self.grad_z))
                if value is not None and value >= limit]
        self.run = self.run + 1 if hits else 0
        if self.aside:
            self.aside -= 1
        elif self.run > self.max_run:  # not isolated: a new level the median must take in
            self.aside = self.window // 2
        skip = bool(hits) and not self.aside
        if not skip:
            self._loss.add(loss)
            if grad_ok:
                self._grad.add(grad_norm)  # type: ignore[arg-type]
        return SkipDecision(skip, "+".join(hits), loss_z, grad_z)

    def state_dict(self) -> dict[str, Any]:
        return {"loss": list(self._loss.values), "grad": list(self._grad.values), "run": self.run,
                "aside": self.aside}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loss, self._grad = RobustWindow(self.window), RobustWindow(self.window)
        for value in state.get("loss", ()):
            self._loss.add(float(value))
        for value in state.get("grad", ()):
            self._grad.add(float(value))
        self.run = int(state.get("run", 0))
        self.aside = int(state.get("aside", 0))


def scan(steps: Iterable[tuple[float, float | None]], **settings: Any) -> list[SkipDecision]:
    """The rule run offline over ``(loss, grad_norm)`` pairs, one decision per step."""
    rule = SkipRule(**settings)
    return [rule.decide(loss, grad) for loss, grad in steps]
