"""Parameter bounds: every change the policy asks for stays within its limits.

The policy never knows absolute values it did not set: the learning rate is
tracked as a *cumulative factor* of the base LR the trainer's guard recorded
at start (1.0 = untouched). Decreases never take it below ``min_lr_factor``,
restores never above the ceiling: 1.0, until recurring explosions lower it
(:meth:`LrFactor.lower_ceiling`).

A rollback restores the guard's state from the checkpoint, LR multiplier
included, so the factor in effect after a rollback is the one at the
checkpoint's step: :class:`LrFactor` keeps a short log of (step, factor) to
answer :meth:`LrFactor.at` and truncates it when the timeline is rewound. The
clipping goes back with it, so :class:`ClipNorm` keeps the same kind of log
(:class:`StepLog`).
"""

from __future__ import annotations

import math
from typing import Any, Generic, TypeVar

# The log of LR changes is short in practice (one entry per change); this cap
# keeps it bounded on any run: the oldest entries fold into the baseline.
MAX_LR_LOG = 256
_EPS = 1e-12
V = TypeVar("V")


def effective_decrease(current: float, factor: float, floor: float) -> float:
    """The factor keeping ``current * factor`` >= ``floor`` (1.0: already at the floor)."""
    if current <= floor * (1 + 1e-9):
        return 1.0
    return max(factor, floor / current)


def effective_increase(current: float, factor: float, ceiling: float = 1.0) -> float:
    """The factor keeping ``current * factor`` <= ``ceiling`` (1.0: already at the ceiling)."""
    if current >= ceiling * (1 - 1e-9):
        return 1.0
    return min(factor, ceiling / current)


class StepLog(Generic[V]):
    """A setting the trainer has from a step on, by step: what a rollback gives back.

    ``log`` holds (step from which it holds, value), step-sorted, at most
    :data:`MAX_LR_LOG` entries; older ones fold into ``baseline``, the value in
    force before the first entry.
    """

    def __init__(self, baseline: V) -> None:
        self.baseline = baseline
        self.log: list[tuple[int, V]] = []

    def at(self, step: int) -> V:
        """The value in force at ``step`` (one recorded at step s holds for s and later)."""
        found = self.baseline
        for when, value in self.log:
            if when > step:
                break
            found = value
        return found

    def record(self, step: int, value: V) -> None:
        """``value`` holds from ``step`` on (later entries belonged to an abandoned timeline)."""
        self.log = [(s, v) for s, v in self.log if s < step]
        self.log.append((step, value))
        while len(self.log) > MAX_LR_LOG:
            self.baseline = self.log.pop(0)[1]

    def truncate_after(self, target_step: int) -> None:
        """The timeline goes back to ``target_step``: forget the entries after it."""
        self.log = [(s, v) for s, v in self.log if s <= target_step]

    def forget_before(self, step: int) -> None:
        """Fold entries before ``step`` (no checkpoint there any more) into the baseline."""
        while len(self.log) > 1 and self.log[1][0] <= step:
            self.log.pop(0)
        if self.log and self.log[0][0] <= step:
            self.baseline = self.log.pop(0)[1]


class LrFactor(StepLog[float]):
    """The cumulative LR factor the policy has applied, with its history by step."""

    def __init__(self, floor: float) -> None:
        super().__init__(1.0)  # the factor in effect before the first logged entry
        self.floor = floor
        self.ceiling = 1.0  # restores stop here; recurring explosions lower it

    @property
    def current(self) -> float:
        return self.log[-1][1] if self.log else self.baseline

    def set(self, step: int, factor: float) -> None:
        """``factor`` holds from ``step`` on (later entries belonged to an abandoned timeline)."""
        factor = min(1.0, max(self.floor, factor))
        if abs(factor - 1.0) < 1e-9:
            factor = 1.0
        self.record(step, factor)

    def decrease(self, step: int, factor: float) -> float | None:
        """Lower the LR by ``factor`` (bounded); the factor to send, or None at the floor."""
        applied = effective_decrease(self.current, factor, self.floor)
        if applied >= 1.0:
            return None
        self.set(step, self.current * applied)
        return applied

    def lower_ceiling(self, factor: float) -> float:
        """The LR that exploded again is not safe: restores now stop at ``factor`` x the lower of
        the ceiling and the current factor (never below the floor). Returns the new ceiling."""
        self.ceiling = max(self.floor, min(self.ceiling, self.current) * factor)
        return self.ceiling

    def restore(self, step: int, factor: float) -> float | None:
        """Raise the LR by ``factor`` towards the ceiling; the factor to send, or None there."""
        applied = effective_increase(self.current, factor, self.ceiling)
        if applied <= 1.0:
            return None
        self.set(step, self.current * applied)
        return applied

    def rewind(self, target_step: int) -> float:
        """The timeline goes back to ``target_step``: forget later changes; the factor then."""
        self.truncate_after(target_step)
        return self.current

    def state_dict(self) -> dict[str, Any]:
        return {
            "baseline": self.baseline,
            "ceiling": self.ceiling,
            "log": [[s, f] for s, f in self.log],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.baseline = float(state["baseline"])
        self.ceiling = float(state.get("ceiling", 1.0))  # snapshots older than the ceiling: base
        self.log = [(int(s), float(f)) for s, f in state["log"]]


class ClipNorm(StepLog[float | None]):
    """The clipping the policy asked for: None until it first enables clipping.

    Like the LR, the clipping in the trainer goes back to the checkpoint's on a rollback (the
    policy sends its own again right after): the log keeps what the trainer had from which step
    on (None: none of the policy's), so that what a recovery set can be given back to the
    checkpoint's (:meth:`at`)."""

    def __init__(self, initial: float, tighten: float, low: float, high: float) -> None:
        super().__init__(None)
        self.initial, self.tighten_factor, self.low, self.high = initial, tighten, low, high
        self.norm: float | None = None

    def mark(self, step: int) -> None:
        """The trainer has ``norm`` from ``step`` on (later entries: an abandoned timeline)."""
        self.record(step, self.norm)

    def rewind(self, target_step: int) -> float | None:
        """The timeline goes back to ``target_step``: the clipping the trainer has then."""
        self.truncate_after(target_step)
        return self.at(target_step)

    def enable_or_tighten(self, floor: float | None = None) -> float | None:
        """Enable at ``initial`` or tighten a notch (not below floor/low); None if unchanged."""
        low = max(self.low, floor or 0.0)
        if self.norm is None:
            new = min(self.high, max(self.low, self.initial))
        else:
            new = max(low, self.norm * self.tighten_factor)
            if new >= self.norm - _EPS:
                return None
        self.norm = new
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"norm": self.norm, "baseline": self.baseline, "log": [list(e) for e in self.log]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norm = None if state["norm"] is None else float(state["norm"])
        self.baseline = state.get("baseline")  # (snapshots older than the log: none)
        self.log = [(int(s), None if n is None else float(n)) for s, n in state.get("log", [])]


class BatchSizeFactor:
    """Cumulative batch-size factor relative to the start, never below ``floor``."""

    def __init__(self, floor: float) -> None:
        self.floor = floor
        self.current = 1.0

    def decrease(self, factor: float) -> float | None:
        applied = effective_decrease(self.current, factor, self.floor)
        if applied >= 1.0:
            return None
        self.current *= applied
        return applied


class Eps:
    """The optimizer's eps as the policy set it: only raised, never above ``high``."""

    def __init__(self, initial: float, high: float) -> None:
        self.value, self.high = initial, high

    def increase(self, factor: float) -> float | None:
        new = min(self.high, self.value * factor)
        if not math.isfinite(new) or new <= self.value * (1 + 1e-9):
            return None
        self.value = new
        return new
