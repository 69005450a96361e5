"""Is the run healthy right now, as far as the trainer itself can tell?

Two sources: non-finite values the guard saw itself in the last
``window`` steps, and anomaly actions it received without a healthy stretch
of ``stretch`` finite steps since. A checkpoint taken while unhealthy is
marked so, and rotation never lets it evict the newest healthy one.
"""

from __future__ import annotations

from typing import Any


class HealthTracker:
    def __init__(self, window: int = 10, stretch: int = 25) -> None:
        self.window = window
        self.stretch = stretch
        self.last_nonfinite: int | None = None
        self.anomaly_open = False
        self.finite_run = 0

    def observe(self, step: int, finite: bool) -> None:
        if not finite:
            self.last_nonfinite = step
            self.finite_run = 0
            return
        self.finite_run += 1
        if self.anomaly_open and self.finite_run >= self.stretch:
            self.anomaly_open = False

    def on_anomaly(self) -> None:
        self.anomaly_open = True
        self.finite_run = 0

    def healthy(self, step: int) -> bool:
        recent = self.last_nonfinite is not None and step - self.last_nonfinite <= self.window
        return not (self.anomaly_open or recent)

    def state_dict(self) -> dict[str, Any]:
        return {
            "last_nonfinite": self.last_nonfinite,
            "anomaly_open": self.anomaly_open,
            "finite_run": self.finite_run,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_nonfinite = state.get("last_nonfinite")
        self.anomaly_open = bool(state.get("anomaly_open", False))
        self.finite_run = int(state.get("finite_run", 0))
