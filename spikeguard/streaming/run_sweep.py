"""Which runs a worker stops holding, and when: idle past a TTL, or ended by their trainer.

An idle run's pending outputs go out before it goes (``stage.flush_runs``);
an ended one leaves the worker's partition map at once and its per-run metric
series after ``metrics_linger_s``, so that the next scrape still sees its last
values (unless the run came back meanwhile).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from spikeguard.streaming.stage import Output, Stage

log = logging.getLogger(__name__)


class RunSweep:
    def __init__(
        self, stage: Stage, metrics: Any, run_idle_ttl_s: float, metrics_linger_s: float, group: str
    ) -> None:
        self.stage, self.metrics, self.group = stage, metrics, group
        self.run_idle_ttl_s = run_idle_ttl_s
        self.metrics_linger_s = metrics_linger_s
        self._linger: deque[tuple[float, str]] = deque()
        self._next_sweep = 0.0
        self._idled = 0  # of the runs ended since the last drain, how many for idling
        self._high = 0  # most runs in the partition map since it was last rebuilt
        self._in_memory = metrics.runs_in_memory.labels(stage.name)

    def evict_idle(self, now: float, force: bool = False) -> list[Output]:
        """Runs with no record for the idle TTL: what they still hold goes out, then they go."""
        if now < self._next_sweep and not force:
            return []
        # Every tenth of the TTL (at most a minute): the scan is O(runs), not per batch.
        self._next_sweep = now + min(60.0, self.run_idle_ttl_s / 10)
        idle = self.stage.idle_runs(now, self.run_idle_ttl_s)
        if not idle:
            return []
        outputs = self.stage.flush_runs(idle)
        self.stage.end_runs(idle)
        self._idled += len(idle)
        self.metrics.runs_evicted.labels(self.stage.name, "idle").inc(len(idle))
        log.info(
            "%s: %d runs idle for over %.0fs evicted", self.group, len(idle), self.run_idle_ttl_s
        )
        return outputs

    def ended(
        self, now: float, run_partition: dict[str, int], popped: dict[str, int] | None = None
    ) -> list[str]:
        """The runs the stage ended since the last call, gone from ``run_partition`` (in place).

        ``popped``: filled with the ended runs' partitions, as they were.
        """
        ended = self.stage.drain_ended()
        if ended:
            if len(ended) > self._idled:
                self.metrics.runs_evicted.labels(self.stage.name, "ended").inc(
                    len(ended) - self._idled
                )
            self._idled = 0
            due = now + self.metrics_linger_s
            self._high = max(self._high, len(run_partition))
            for run_id in ended:
                partition = run_partition.pop(run_id, None)
                if popped is not None and partition is not None:
                    popped[run_id] = partition
                self._linger.append((due, run_id))
            if len(run_partition) < self._high // 4:  # its table shrinks with the runs
                kept = dict(run_partition)
                run_partition.clear()  # (a dict keeps its largest table: rebuilt in place)
                run_partition.update(kept)
                self._high = len(run_partition)
        linger = self._linger
        while linger and linger[0][0] <= now:
            run_id = linger.popleft()[1]
            if run_id not in run_partition:  # not back since
                self.metrics.forget_run(run_id)
        runs = getattr(self.stage, "runs", None)
        if runs is not None:
            self._in_memory.set(len(runs))
        return ended
