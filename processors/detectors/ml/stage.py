"""The ``ml`` worker's stage: the detector stage, plus dropping the forests of quiet runs.

A worker holding 10,000 runs holds a live isolation forest for each (~35 kB; see
:mod:`.forest`). A run that has sent nothing for ``MLConfig.release_idle_s``
seconds (a trainer paused, evaluating, checkpointing, or gone without saying so
before the idle TTL evicts it) gives its forest back; its first step after that
refits the forest from the rows it keeps (same rows and seed, same trees), so
no verdict changes: only that step takes a fit's time (~20 ms) longer.
"""

from __future__ import annotations

from typing import Callable

from pydantic import SecretStr

from spikeguard.processors.detector_stage import DetectorStage
from spikeguard.processors.detectors.ml.detector import MLDetector
from spikeguard.schemas import Topics
from spikeguard.streaming.stage import Output


class MLStage(DetectorStage):
    """steps -> verdicts for the ``ml`` detector; quiet runs' forests are released."""

    def __init__(
        self,
        topics: Topics,
        factory: Callable[[str], MLDetector],
        release_idle_s: float,
        signing_key: SecretStr | None = None,
    ) -> None:
        super().__init__(topics, "ml", factory, signing_key=signing_key)
        self.release_idle_s = release_idle_s
        # A sweep over every run costs ~1 ms per 10,000: a few per idle period is plenty.
        self._sweep_every = release_idle_s / 4
        self._next_sweep = -float("inf")
        self.released = 0  # forests released so far (each is refitted if its run returns)

    def tick(self, now: float) -> list[Output]:
        if now >= self._next_sweep:
            self._next_sweep = now + self._sweep_every
            self.release_quiet(now)
        return []

    def release_quiet(self, now: float) -> int:
        """Release the forests of runs with no record for more than ``release_idle_s``."""
        quiet = now - self.release_idle_s
        count = 0
        for run_id, seen in self.last_seen.items():
            if seen < quiet:
                detector = self.runs.get(run_id)
                if isinstance(detector, MLDetector) and detector.release():
                    count += 1
        self.released += count
        return count
