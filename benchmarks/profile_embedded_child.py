"""The embedded pipeline alone: its CPU per step, by stage, on a recorded step stream.

A Guard trains the 0.5 ms MLP of ``bench_embedded_models.py`` on the default
runtime for ``--steps`` steps while every message its process sends down to
the pipeline's child (the run's events, the step fields 32 at a time) is
recorded. The recording is then replayed, paced as a trainer at ``--rate``
steps per second would send it, into the pipeline's workers run as threads of
this process (the code the child runs, on its bus, with its key), and the CPU
of each of those threads is read: CPU microseconds per step by worker, and
the bridge's own share (building and signing the steps). With ``--profile
OUT`` each worker loop is also under cProfile on its CPU clock
(``OUT.NAME.prof``; read shares within a worker from it, sizes from the
threads' CPU). ``--child`` replays into a real child process instead and
reads its CPU from ``/proc`` (the figure a user's machine pays).

    python benchmarks/profile_embedded_child.py [--steps 2000] [--rate 2000] [--child]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_embedded_cost import _cpu_s
from bench_embedded_models import MODELS
from stage_clock import StageClock, instrument_worker, threads_cpu

from spikeguard.bus.embedded import EmbeddedBus
from spikeguard.producers import Guard, GuardConfig
from spikeguard.runtime import child as child_module
from spikeguard.runtime import open_runtime
from spikeguard.runtime.base import Runtime, embedded_bus
from spikeguard.runtime.threads import start_workers
from spikeguard.schemas import Decision, Topics
from spikeguard.settings import Settings, load_settings
from spikeguard.streaming import worker as worker_loop


def record(steps: int) -> tuple[Settings, list[Any]]:
    """The settings of a guarded run and every message its process sent down to the child."""
    model, _opt, step = MODELS["mlp"]()
    runtime = open_runtime(load_settings({}))
    pipeline = runtime.child
    if pipeline is None:
        raise SystemExit("no child process here: nothing to record")
    assert isinstance(pipeline, child_module.ChildPipeline)  # Runtime holds it as an object
    sent: list[Any] = []
    original = pipeline._down.send

    def send(message: Any) -> None:
        if isinstance(message, tuple) and message[0] == child_module.RECORDS:
            sent.append(message)
        original(message)

    pipeline._down.send = send  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        config = GuardConfig(checkpoint_dir=tmp, checkpoint_every=0, resume=False)
        guard = Guard(model, _opt, run_id="profile-child", config=config, runtime=runtime)
        for _ in range(steps):
            guard.step(step())
        guard.publisher.flush(30.0)
        guard.close()
    runtime.close()
    return runtime.settings, sent


def rechunked(messages: list[Any], handoff: int) -> list[Any]:
    """The recording's records in messages of ``handoff`` steps each (other records in place):
    the trainer's publisher at a given rate (it sends what 20 ms brought)."""
    items = [item for message in messages for item in message[1]]
    out: list[Any] = []
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if sum(1 for i in chunk if i[4] is not None) >= handoff:
            out.append((child_module.RECORDS, chunk))
            chunk = []
    if chunk:
        out.append((child_module.RECORDS, chunk))
    return out


def _step_count(message: Any) -> int:
    return sum(1 for item in message[1] if item[4] is not None)


class _Replay:
    """A pipe end that hands out the recorded messages, paced at ``rate`` steps per second."""

    def __init__(self, messages: list[Any], rate: float) -> None:
        self.messages = list(messages)
        self.rate = rate
        self.started = 0.0
        self.steps = 0

    def recv(self) -> Any:
        if not self.messages:
            return None
        if not self.started:
            self.started = time.perf_counter()
        due = self.started + self.steps / self.rate
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        message = self.messages.pop(0)
        self.steps += _step_count(message)
        return message


class _Decided:
    """The steps decided so far, read by a consumer group of its own (subscribed before any step)."""

    def __init__(self, bus: EmbeddedBus, topics: Topics) -> None:
        self._consumer = bus.consumer("profile-decided", [topics.decisions])
        self.steps: set[int] = set()

    def wait(self, steps: int, timeout_s: float = 60.0) -> int:
        deadline = time.monotonic() + timeout_s
        while len(self.steps) < steps and time.monotonic() < deadline:
            for record in self._consumer.poll(10_000, 0.05):
                self.steps.add(record.decoded(Decision).step)
        self._consumer.close()
        return len(self.steps)


def _clock_seams(clock: StageClock, workers: list[Any]) -> None:
    """Timers on the workers' seams, on signing and on the per-verdict copies."""
    from spikeguard.processors import detector_stage
    from spikeguard.schemas import signing

    for worker in workers:
        instrument_worker(clock, worker)
    clock.wrap(signing, "sign", "sign (canonical JSON + HMAC)")
    clock.wrap(detector_stage, "with_values", "verdicts copied with the step's values")
    clock.wrap(worker_loop, "observe_outputs", "output metrics")
    clock.wrap(worker_loop, "handle_batch", "batch transaction")


def replay_threads(
    settings: Settings,
    messages: list[Any],
    rate: float,
    profile: str | None,
    names: tuple[str, ...],
    clock: StageClock | None = None,
) -> dict[str, float]:
    """CPU seconds per thread while the recording is replayed into the workers as threads."""
    if profile:
        run = worker_loop.Worker.run

        def profiled(self: Any) -> None:
            profiler = cProfile.Profile(time.thread_time)
            profiler.enable()
            try:
                run(self)
            finally:
                profiler.disable()
                profiler.dump_stats(f"{profile}.{self.stage.name}.prof")

        worker_loop.Worker.run = profiled  # type: ignore[method-assign]
    bus = embedded_bus(settings)
    topics = Topics(settings.topic_prefix)
    bus.create_topics(topics.compacted(), compacted=True)
    bus.create_topics(topics.all())
    runtime = Runtime(bus, topics, settings)
    start_workers(runtime, names)
    if clock is not None:
        _clock_seams(clock, runtime.workers)
    decided = _Decided(bus, topics)
    steps = sum(map(_step_count, messages))
    before = threads_cpu()
    bridge0 = time.thread_time()
    child_module.receive(bus, _Replay(messages, rate), settings.keys(), topics.dlq)  # type: ignore[arg-type]
    bridge = time.thread_time() - bridge0
    count = decided.wait(steps)
    after = threads_cpu()
    cpu = {name: after[name] - before.get(name, 0.0) for name in after}
    cpu = {name.split("#")[0]: s for name, s in cpu.items() if name.startswith("spikeguard-")}
    cpu["bridge (build and sign the steps)"] = bridge
    cpu["decided"] = count
    runtime.close()
    return cpu


def replay_child(settings: Settings, messages: list[Any], rate: float) -> dict[str, float]:
    """CPU seconds of a real child process while the recording is replayed into it."""
    bus = embedded_bus(settings)
    topics = Topics(settings.topic_prefix)
    bus.create_topics(topics.compacted(), compacted=True)
    bus.create_topics(topics.all())
    pipeline = child_module.ChildPipeline(Runtime(bus, topics, settings))
    counter = _Decided(bus, topics)
    steps = sum(map(_step_count, messages))
    start = _cpu_s(pipeline.process.pid)
    replay = _Replay(messages, rate)
    while (message := replay.recv()) is not None:
        pipeline._down.send(message)
    decided = counter.wait(steps)
    cpu = _cpu_s(pipeline.process.pid) - start
    pipeline.close()
    bus.close()
    return {"child": cpu, "decided": decided}


def batched_limit(settings: Settings, messages: list[Any]) -> float:
    """CPU seconds the backtest's batched path (:class:`DirectPipeline`: detectors and fusion,
    no bus, no signing) takes to judge the same steps in this process: the figure to aim at."""
    from spikeguard.lab.backtest_pump import DirectPipeline
    from spikeguard.schemas import StepEvent

    events = [StepEvent(**item[4]) for message in messages for item in message[1] if item[4]]
    offline = load_settings({"topic_prefix": settings.topic_prefix}, env={})
    pipeline = DirectPipeline(offline)
    started = time.thread_time()
    pipeline.feed(events)
    pipeline.finish()
    return time.thread_time() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=2000.0, help="steps per second replayed")
    parser.add_argument("--child", action="store_true", help="replay into a real child process")
    parser.add_argument("--profile", metavar="OUT", help="cProfile each worker into OUT.NAME.prof")
    parser.add_argument(
        "--layout",
        choices=["embedded", "separate"],
        default="embedded",
        help="the workers: the embedded runtime's (detectors co-hosted), or one per detector",
    )
    parser.add_argument("--stages", action="store_true", help="CPU per step on the workers' seams")
    parser.add_argument(
        "--handoff",
        type=int,
        default=0,
        help="steps per message down (0: as recorded; the publisher sends what 20 ms brought: "
        "40 at 2,000 steps/s)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--recording", metavar="FILE", help="replay FILE (made on first use)")
    args = parser.parse_args(argv)
    if args.recording and Path(args.recording).exists():
        settings, messages = pickle.loads(Path(args.recording).read_bytes())
    else:
        settings, messages = record(args.steps)
        if args.recording:
            Path(args.recording).write_bytes(pickle.dumps((settings, messages)))
    if args.handoff:
        messages = rechunked(messages, args.handoff)
    steps = sum(map(_step_count, messages))
    if args.child:
        cpu = replay_child(settings, messages, args.rate)
    else:
        from spikeguard.components import COMPONENTS, EMBEDDED_COMPONENTS

        names = EMBEDDED_COMPONENTS if args.layout == "embedded" else COMPONENTS
        clock = StageClock() if args.stages else None
        cpu = replay_threads(settings, messages, args.rate, args.profile, names, clock)
        if clock is not None:
            print("CPU us per step on the seams (exclusive):")
            for label, s in sorted(clock.seconds.items(), key=lambda kv: -kv[1]):
                print(f"  {label:50s} {1e6 * s / steps:8.1f}")
    decided = int(cpu.pop("decided"))
    limit = batched_limit(settings, messages)
    per_step = {name: round(1e6 * s / steps, 1) for name, s in sorted(cpu.items())}
    total = round(sum(per_step.values()), 1)
    if args.json:
        print(
            json.dumps(
                {
                    "steps": steps,
                    "decided": decided,
                    "cpu_us_per_step": per_step,
                    "batched_limit_us_per_step": round(1e6 * limit / steps, 1),
                }
            )
        )
        return 0
    print(f"{steps} steps replayed at {args.rate:.0f}/s, {decided} decided; CPU us per step:")
    for name, us in per_step.items():
        print(f"  {name:40s} {us:8.1f}")
    print(f"  {'total':40s} {total:8.1f}")
    print(f"the backtest's batched path on the same steps, same process: {1e6 * limit / steps:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
