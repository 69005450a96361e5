"""Where the guarded step's time goes in the embedded default: the training thread under cProfile.

The 0.5 ms MLP of ``bench_embedded_models.py``, guarded on the default runtime
(the pipeline in a child process), ``--steps`` steps with the training thread
profiled on its CPU clock (a wall clock on a loaded machine measures the queue
for the CPU). Printed: CPU microseconds per step of the training thread, of the
trainer's other threads (the publisher, the bridge's forwarders) and of the
child, then the functions with the most cumulative CPU per step inside
``Guard.step``.

``--parts`` times the step's parts instead, without cProfile (whose ~0.8 µs
per Python call triples the small ones): each part of ``Guard.step`` is wrapped
by a timer on the thread's CPU clock, and printed is each part's own CPU per
step (its callees that are parts themselves taken out) with its calls per
step; what no part covers is the halves' own Python. The timers' own cost
(calibrated first, about a microsecond per timed call) is taken out of the
caller's share.

``--bare`` runs no profiler at all: the step's CPU alone, for an A/B of two
versions run in turn.

    python benchmarks/profile_embedded.py [--steps 2000] [--top 20] [--parts | --bare]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_embedded_cost import _cpu_s, child_pipeline
from bench_embedded_models import MODELS

from spikeguard.producers import Guard, GuardConfig
from spikeguard.producers import guard as guard_module
from spikeguard.producers import step_halves as halves_module
from spikeguard.runtime import open_runtime
from spikeguard.settings import load_settings


class PartClock:
    """Exclusive CPU time (the thread's clock) of wrapped callables, nested calls taken out."""

    def __init__(self) -> None:
        self.own: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.children: Counter[str] = Counter()  # timed calls made from inside each part
        self._stack: list[list[Any]] = []  # [name, CPU of timed callees] per open call
        self.overhead = 0.0  # a timed call's own cost, outside its measured window

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, stack, own, calls, children = (
            time.thread_time,
            self._stack,
            self.own,
            self.calls,
            self.children,
        )

        def timed(*args: Any, **kwargs: Any) -> Any:
            if stack:
                children[stack[-1][0]] += 1
            frame: list[Any] = [name, 0.0]  # [name, CPU of timed callees], as in _stack
            stack.append(frame)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = clock() - start
                stack.pop()
                own[name] += spent - frame[1]
                calls[name] += 1
                if stack:
                    stack[-1][1] += spent

        return timed

    def calibrate(self, n: int = 20000) -> None:
        """The cost a timed call adds to its caller beyond what it measures itself."""
        probe = PartClock()
        inner = probe.wrap("inner", lambda: None)

        def outer() -> None:
            for _ in range(n):
                inner()

        probe.wrap("outer", outer)()
        bare = time.thread_time()
        for _ in range(n):
            (lambda: None)()
        bare = time.thread_time() - bare
        self.overhead = max(0.0, (probe.own["outer"] - bare) / n)

    def table(self, steps: int) -> list[tuple[str, float, float]]:
        """(part, own CPU µs per step with its timed callees' overhead taken out, calls per step)."""
        rows = [
            (
                name,
                1e6 * (self.own[name] - self.overhead * self.children[name]) / steps,
                self.calls[name] / steps,
            )
            for name in self.own
        ]
        return sorted(rows, key=lambda row: -row[1])


def _instrument(guard: Guard, clock: PartClock) -> None:
    """Wrap each part the guarded step calls, under a name that says what it is."""
    halves = guard.halves
    on = {
        "Guard.step (own Python)": (guard, "step"),
        "Guard.before_update (own)": (guard, "before_update"),
        "Guard.after_update (own)": (guard, "after_update"),
        "misuse: usage.before_step": (guard.usage, "before_step"),
        "misuse: usage.after_step": (guard.usage, "after_step"),
        "halves.start": (halves, "start"),
        "halves.before_update (own Python)": (halves, "before_update"),
        "halves.after_update (own Python)": (halves, "after_update"),
        "amp.step (own)": (guard.amp, "step"),
        "optimizer step (lr.step: the LR factor, the user's optimizer)": (guard.lr, "step"),
        "statistics: stats.compute": (guard.stats, "compute"),
        "skip rule: judge": (guard.skip_rule, "judge"),
        "skip rule: learn": (guard.skip_rule, "learn"),
        "halves._judge_outlier": (halves, "_judge_outlier"),
        "StepEvent: events.step": (guard.events, "step"),
        "StepEvent: publisher.submit": (guard.publisher, "submit"),
        "StepEvent: publisher.submit_step": (guard.publisher, "submit_step"),
        "evidence: published.keep": (guard.actions.published, "keep"),
        "actions: applier.collect": (guard.applier, "collect"),
        "actions: actions.due": (guard.actions, "due"),
        "actions: applier.finish": (guard.applier, "finish"),
        "amp.begin": (guard.amp, "begin"),
        "amp.scale": (guard.amp, "scale"),
        "amp.count": (guard.amp, "count"),
        "lr.effective": (guard.lr, "effective"),
        "clipper.clip": (guard.clipper, "clip"),
        "clipper.observe": (guard.clipper, "observe"),
        "update norm: updates.last_update": (guard.updates, "last_update"),
        "update norm: updates.before_update": (guard.updates, "before_update"),
        "update norm: updates.after_update": (guard.updates, "after_update"),
        "health.observe": (guard.health, "observe"),
        "data position: position.record": (guard.position, "record"),
        "incidents.step": (guard.incidents, "step"),
        "rerun.before_step": (guard.rerun, "before_step"),
        "checkpoints.save_if_due": (guard.checkpoints, "save_if_due"),
        "checkpoints.drain": (guard.checkpoints, "drain"),
    }
    for name, (owner, attr) in on.items():
        if hasattr(owner, attr):  # (an older version may not have the part)
            setattr(owner, attr, clock.wrap(name, getattr(owner, attr)))
    for module, attr in ((guard_module, "check_loss"), (halves_module, "own_view")):
        if not hasattr(module, attr):
            continue
        setattr(
            module,
            attr,
            clock.wrap(f"{module.__name__.rsplit('.', 1)[-1]}.{attr}", getattr(module, attr)),
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument(
        "--parts", action="store_true", help="timers on the step's parts instead of cProfile"
    )
    parser.add_argument("--bare", action="store_true", help="no profiler: the step's CPU alone")
    args = parser.parse_args(argv)
    if args.parts or args.bare:
        torch.set_num_threads(1)  # the step's own cost, not a wait for torch's second thread
    model, opt, step = MODELS["mlp"]()
    runtime = open_runtime(load_settings({}))
    with tempfile.TemporaryDirectory() as tmp:
        config = GuardConfig(checkpoint_dir=tmp, checkpoint_every=0, resume=False)
        guard = Guard(model, opt, run_id="profile-embedded", config=config, runtime=runtime)
        for _ in range(50):
            guard.step(step())
        child = child_pipeline(runtime)
        child_start = _cpu_s(child.process.pid) if child is not None else 0.0
        thread0, process0 = time.thread_time(), time.process_time()
        profile = cProfile.Profile(time.thread_time)
        parts = PartClock()
        if args.parts:
            parts.calibrate()
            _instrument(guard, parts)
        in_step = 0.0
        for _ in range(args.steps):
            loss = step()
            t = time.thread_time()
            profiled = not (args.parts or args.bare)
            if profiled:
                profile.enable()
            guard.step(loss)
            if profiled:
                profile.disable()
            in_step += time.thread_time() - t
        thread = time.thread_time() - thread0
        other = time.process_time() - process0 - thread
        guard.publisher.flush(30.0)
        child_cpu = _cpu_s(child.process.pid) - child_start if child is not None else 0.0
        guard.close()
    runtime.close()
    n = args.steps
    print(
        f"CPU us per step: training thread {1e6 * thread / n:.0f} (of which Guard.step "
        f"{1e6 * in_step / n:.0f}, {'not ' if args.bare else ''}profiled), "
        f"trainer's other threads {1e6 * other / n:.0f}, "
        f"child {1e6 * child_cpu / n:.0f} ({'child' if child is not None else 'threads'})"
    )
    if args.bare:
        return 0
    if args.parts:
        print(f"timer overhead per timed call {1e6 * parts.overhead:.2f} us (taken out)")
        print("| part | own CPU us per step | calls per step |")
        print("|---|---|---|")
        rows = parts.table(n)
        for name, us, calls in rows:
            print(f"| {name} | {us:.1f} | {calls:.2f} |")
        print(f"| all timed parts | {sum(us for _, us, _ in rows):.1f} | |")
        return 0
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
