"""``spikeguard ARGS`` under cProfile or under stage timers, on each thread's CPU clock.

    python benchmarks/cprofile_spikeguard.py OUT.prof backtest FILE --out OUT.jsonl
    python benchmarks/cprofile_spikeguard.py OUT.prof worker NAME
    python benchmarks/cprofile_spikeguard.py --stages OUT.json backtest FILE --out OUT.jsonl

cProfile (the default): the command's main thread is profiled into
``OUT.prof``. A worker loop runs in a thread of its own, which ``python -m
cProfile`` does not see: each :meth:`Worker.run` is profiled in its thread into
``OUT.STAGE.prof`` instead (``OUT.detectors.prof`` for ``worker detectors``).
The clock is ``time.thread_time`` (CPU, not wall: on a loaded machine a
wall-clock profile measures the queue for the CPU); its overhead (~0.8 µs per
Python call) inflates call-heavy code, so read shares within a stage from it,
and the stages' sizes from ``--stages``.

``--stages``: :mod:`stage_clock`'s timers on the seams instead (each detector by
name, fusion, decode, signing, encoding, the client's calls, the state save,
the commit), written as JSON to ``OUT.json`` (a worker: ``OUT.STAGE.json``),
with the CPU of the process and of each thread over the same span.
``benchmarks/profile_stages.py`` turns either into CPU microseconds per step.
"""

from __future__ import annotations

import cProfile
import json
import resource
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # stage_clock.py next to this file
from stage_clock import StageClock, instrument_worker, threads_cpu

from spikeguard.cli import main
from spikeguard.streaming import worker as worker_loop


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def profiled(path_of: Callable[[object], str], call: Callable) -> Callable:
    """``call`` profiled in the calling thread, written to ``path_of(first argument)`` when it returns."""

    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        profiler = cProfile.Profile(time.thread_time)
        started = time.thread_time()
        profiler.enable()
        try:
            return call(*args, **kwargs)
        finally:
            profiler.disable()
            path = path_of(args[0] if args else None)
            profiler.dump_stats(path)
            with open(path + ".json", "w", encoding="utf-8") as handle:
                json.dump({"thread_cpu_s": time.thread_time() - started}, handle)

    return run


def clocked(
    clock: StageClock, path_of: Callable[[object], str], call: Callable, whole_command: bool = False
) -> Callable:
    """``call`` with the stage timers' totals (and the CPU it spanned) written when it returns.

    ``whole_command``: ``call`` is the command itself, so the CPU before it (start-up) is its own.
    """

    def run(*args, **kwargs):  # type: ignore[no-untyped-def]
        thread0, process0, wall0 = time.thread_time(), _process_cpu(), time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            report = {
                "thread_cpu_s": time.thread_time() - thread0,
                "process_cpu_s": _process_cpu() - process0,
                "process_cpu_before_s": process0,
                "whole_command": whole_command,
                "wall_s": time.perf_counter() - wall0,
                "stages_cpu_s": dict(clock.seconds),
                "stages_wall_s": dict(clock.wall),
                "calls": dict(clock.calls),
                "threads_cpu_s": threads_cpu(),
            }
            Path(path_of(args[0] if args else None)).write_text(json.dumps(report, indent=1))

    return run


def _stage_timers(clock: StageClock) -> None:
    """Timers on every seam the command may go through (workers and the backtest's pump)."""
    import spikeguard.bus.base as bus_base
    import spikeguard.lab.backtest_input as backtest_input
    import spikeguard.lab.backtest_pump as pump
    import spikeguard.lab.local_skips as local_skips
    import spikeguard.processors.detector_stage as detector_stage
    import spikeguard.schemas.signing as signing
    import spikeguard.streaming.run_settings_stage as run_settings_stage

    clock.wrap(signing.Signer, "sign", "sign (HMAC)")  # what a worker signs its outputs with
    clock.wrap(bus_base, "encode", "encode")
    clock.wrap(detector_stage, "authenticate", "authenticate (HMAC)")
    clock.wrap(run_settings_stage, "authenticate", "authenticate (HMAC)")
    init = worker_loop.Worker.__init__

    def worker_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        instrument_worker(clock, self)

    worker_loop.Worker.__init__ = worker_init  # type: ignore[method-assign]
    pipeline_init = pump.DirectPipeline.__init__

    def pipeline(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        pipeline_init(self, *args, **kwargs)
        for stage in self._detectors:
            clock.wrap(stage, "handle_batch", f"detector: {stage.name}")
        clock.wrap(self._fusion, "handle_batch", "fusion")

    pump.DirectPipeline.__init__ = pipeline  # type: ignore[method-assign]
    clock.wrap(pump.DirectPipeline, "feed", "pump (batches, order)")
    clock.wrap(pump.DirectPipeline, "finish", "pump (batches, order)")

    read = backtest_input.iter_steps
    backtest_input.iter_steps = lambda *a, **k: clock.timed_iterator("read the CSV", read(*a, **k))
    clock.wrap(local_skips.LocalSkips, "observe", "the Guard's skip rule (summary)")


if __name__ == "__main__":
    stages = sys.argv[1] == "--stages"
    out, argv = sys.argv[1 + stages], sys.argv[2 + stages :]
    suffix = ".json" if stages else ".prof"
    stem = out[: -len(suffix)] if out.endswith(suffix) else out
    if stages:
        clock = StageClock()
        _stage_timers(clock)
        # This profiler's point: every Worker's loop, wherever it is started, runs timed.
        worker_loop.Worker.run = clocked(  # type: ignore[method-assign]
            clock,
            lambda w: f"{stem}.{w.stage.name}.json",  # type: ignore[attr-defined]
            worker_loop.Worker.run,
        )
        sys.exit(clocked(clock, lambda _: out, main, whole_command=True)(argv))
    # Or every Worker's loop under cProfile, a file per stage (the class patched, as above).
    worker_loop.Worker.run = profiled(  # type: ignore[method-assign]
        lambda w: f"{stem}.{w.stage.name}.prof",  # type: ignore[attr-defined]
        worker_loop.Worker.run,
    )
    sys.exit(profiled(lambda _: out, main)(argv))
