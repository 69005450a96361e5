"""Where the guarded step's time goes in the embedded default: the training thread under cProfile.

The 0.5 ms MLP of ``bench_embedded_models.py``, guarded on the default runtime
(the pipeline in a child process), ``--steps`` steps with the training thread
profiled on its CPU clock (a wall clock on a loaded machine measures the queue
for the CPU). Printed: CPU microseconds per step of the training thread, of the
trainer's other threads (the publisher, the bridge's forwarders) and of the
child, then the functions with the most cumulative CPU per step inside
``Guard.step``.

    python benchmarks/profile_embedded.py [--steps 2000] [--top 20]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_embedded_cost import _cpu_s
from bench_embedded_models import MODELS

from spikeguard.producers import Guard, GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.settings import load_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    model, opt, step = MODELS["mlp"]()
    runtime = open_runtime(load_settings({}))
    with tempfile.TemporaryDirectory() as tmp:
        config = GuardConfig(checkpoint_dir=tmp, checkpoint_every=0, resume=False)
        guard = Guard(model, opt, run_id="profile-embedded", config=config, runtime=runtime)
        for _ in range(50):
            guard.step(step())
        child = runtime.child
        child_start = _cpu_s(child.process.pid) if child is not None else 0.0
        thread0, process0 = time.thread_time(), time.process_time()
        profile = cProfile.Profile(time.thread_time)
        in_step = 0.0
        for _ in range(args.steps):
            loss = step()
            t = time.thread_time()
            profile.enable()
            guard.step(loss)
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
        f"{1e6 * in_step / n:.0f}, profiled), trainer's other threads {1e6 * other / n:.0f}, "
        f"child {1e6 * child_cpu / n:.0f} ({'child' if child is not None else 'threads'})"
    )
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
