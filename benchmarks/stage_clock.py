"""CPU time of each stage of a worker loop or a backtest, from a handful of timers on its seams.

``cprofile_spikeguard.py --stages`` puts a timer (``time.thread_time``, the
thread's CPU clock) around each seam of the running command: the Kafka
client's calls, decoding, the stage's admission checks, each hosted detector
by name, fusion, signing, encoding, waiting for acknowledgements, the state
save, the commit. Each timer counts its own time less the timers inside it
(exclusive), so the stages add up to the thread's CPU, and "the loop" is what
no timer covers. Unlike cProfile (~0.8 µs of overhead on every Python call
with a CPU clock, several times the code it measures), the timers cost a
microsecond per timed call, and there are a few per batch plus one or two per
record (signing, encoding).

:func:`threads_cpu` reads every thread's CPU from ``/proc/self/task`` (Linux),
so that the Kafka client's own threads (librdkafka's ``rdk:*``, kafka-python's
sender) count too.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable


class StageClock:
    """Exclusive CPU and wall seconds and calls per label, across threads (each thread its own nesting).

    CPU says what a stage costs; wall says how long the loop spends in it, waits included
    (for the broker's acknowledgements, for the CPU on a loaded machine): the latency's view.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._local = threading.local()

    def timed(self, label: str, call: Callable) -> Callable:
        """``call``, its CPU and wall time (less those of timers inside it) counted under ``label``."""
        cpu_clock, wall_clock = time.thread_time, time.perf_counter
        seconds, wall, calls, local = self.seconds, self.wall, self.calls, self._local

        @functools.wraps(call)
        def run(*args: Any, **kwargs: Any) -> Any:
            stack = getattr(local, "stack", None)
            if stack is None:
                stack = local.stack = []
            inner = [0.0, 0.0]  # CPU, wall of the timers inside this one
            stack.append(inner)
            cpu0, wall0 = cpu_clock(), wall_clock()
            try:
                return call(*args, **kwargs)
            finally:
                cpu, elapsed = cpu_clock() - cpu0, wall_clock() - wall0
                stack.pop()
                seconds[label] += cpu - inner[0]
                wall[label] += elapsed - inner[1]
                calls[label] += 1
                if stack:
                    outer = stack[-1]
                    outer[0] += cpu
                    outer[1] += elapsed

        return run

    def wrap(self, owner: Any, attribute: str, label: str) -> None:
        """Time ``owner.attribute`` (an instance's method, a class's, or a module's function)."""
        setattr(owner, attribute, self.timed(label, getattr(owner, attribute)))

    def timed_iterator(self, label: str, iterable: Any):  # type: ignore[no-untyped-def]
        """``iterable``, the CPU time of producing each item counted under ``label``."""
        iterator = iter(iterable)
        step = self.timed(label, iterator.__next__)
        while True:
            try:
                item = step()
            except StopIteration:
                return
            yield item


def threads_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each live thread of this process, by thread name + id."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        tid = int(task.name)
        out[f"{names.get(tid, comm)}#{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def instrument_worker(clock: StageClock, worker: Any) -> None:
    """Timers on one :class:`~spikeguard.streaming.worker.Worker`'s seams (its instance only)."""
    consumer, producer, stage = worker._consumer, worker._producer, worker.stage
    clock.wrap(consumer, "poll", "client: poll")
    clock.wrap(consumer, "commit", "commit")
    clock.wrap(worker, "_decode_all", "decode")
    clock.wrap(worker, "_decode", "admit (order, run limits; HMAC apart)")
    clock.wrap(worker, "_track", "bookkeeping and input metrics")
    clock.wrap(stage, "undo_point", "undo point (batch transaction)")
    clock.wrap(worker, "_publish", "publish (metrics, queueing)")
    clock.wrap(producer, "publish_events", "client: produce")
    clock.wrap(producer, "send_now", "client: send")
    clock.wrap(producer, "flush", "client: wait for acks")
    clock.wrap(worker, "checkpoint", "state save")
    hosted = getattr(stage, "stages", None)
    for detector in hosted or []:
        clock.wrap(detector, "handle_batch", f"detector: {detector.name}")
    if hosted is not None:
        clock.wrap(stage, "packed", "pack a step's verdicts")
    else:
        label = (
            f"detector: {stage.name}"
            if hasattr(stage, "admit") and stage.name not in ("fusion", "actuator")
            else stage.name
        )
        clock.wrap(stage, "handle_batch", label)
    clock.wrap(stage, "tick", "deadlines (tick)")
