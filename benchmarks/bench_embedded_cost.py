"""What the embedded pipeline costs the trainer: step rate with it vs with publishing off.

Three loops on the same tiny CPU model, interleaved in rounds so that machine
noise hits them alike:

- ``unpublished``: ``Guard(..., connect=False)``: the guard's local work
  (statistics, the local skip rule) and nothing on any bus;
- ``threads``: the whole pipeline (four detectors, fusion, actuator) as
  threads of the trainer's process (``worker.embedded_process=false``, the
  default before 2026-12-01);
- ``process``: the default settings: the pipeline's workers in a child
  process bridged to the trainer's bus (``worker.embedded_process=true``).

Reported per layout (medians over rounds): steps/s; CPU time per step in the
trainer's process, in its training thread alone (the hook's cost there is
that minus ``unpublished``'s) and, for ``process``, in the child; how many steps the
pipeline had not yet decided when the loop ended (a pipeline that keeps up
costs less than one that drops behind, so a ratio is only honest with that
lag beside it). The ratios to ``unpublished`` (aim >= 0.9) are the median
of each round's ratio (runs next to each other in time), with their range:
on a shared machine absolute rates drift within minutes.

The headline figures come from ``paired``: the default layout and
``unpublished`` in one process, each with its own copy of the model,
stepping in alternating blocks of ``--block`` steps, so that a loaded
machine's noise falls on both alike (whole runs minutes apart on a shared
machine differ by more than what is measured). It reports the step-rate
ratio, the hook's share of the training thread's CPU time (the guarded
thread's extra CPU per step over the unpublished one's, as a share of it)
and the steps missed (dropped by the trainer's queue, or not decided when
the loop ended). The child and the bridge keep working through the
unpublished blocks, so they take the same share of the machine from both:
the ratio is what the trainer's own process pays; ``process`` in rounds
shows the rest.

    python benchmarks/bench_embedded_cost.py [--steps 2000] [--rounds 5] [--block 50] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from decision_tally import DecisionTally

from spikeguard.producers import Guard, GuardConfig

if TYPE_CHECKING:
    from spikeguard.runtime import Runtime
    from spikeguard.runtime.child import ChildPipeline

KINDS = ("unpublished", "threads", "process")


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    return model, opt, x, y


def child_pipeline(runtime: Runtime) -> ChildPipeline | None:
    """The runtime's pipeline process, as its type (Runtime holds it as an object: see its field)."""
    child = runtime.child
    if child is None:
        return None
    from spikeguard.runtime.child import ChildPipeline

    assert isinstance(child, ChildPipeline)
    return child


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _undecided(tally: DecisionTally, last_step: int) -> int:
    """Steps of this run after the newest one the pipeline had decided (read on the trainer's bus)."""
    return last_step - max(tally.update(), default=-1)


def _never_decided(tally: DecisionTally, steps: int) -> set[int]:
    """The steps of this run (0..steps-1) with no decision on the trainer's bus."""
    return set(range(steps)) - tally.update()


def run(kind: str, steps: int, directory: str) -> dict:
    model, opt, x, y = make()
    runtime = child = None
    config = GuardConfig(checkpoint_dir=directory, checkpoint_every=0, resume=False)
    if kind == "unpublished":
        guard = Guard(model, opt, run_id=f"cost-{kind}", config=config, connect=False)
    else:
        from spikeguard.runtime import open_runtime
        from spikeguard.settings import load_settings

        # The defaults, but for threads: what the trainer gets without asking for anything.
        runtime = open_runtime(
            load_settings({"worker.embedded_process": False} if kind == "threads" else {})
        )
        child = child_pipeline(runtime)
        guard = Guard(model, opt, run_id=f"cost-{kind}", config=config, runtime=runtime)
        tally = DecisionTally(guard)
    warm = max(1, steps // 10)
    for i in range(steps):
        if i == warm:
            start, cpu_start, thread_start = (
                time.perf_counter(),
                time.process_time(),
                time.thread_time(),
            )
            child_start = _cpu_s(child.process.pid) if child is not None else 0.0
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.step(loss)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    thread = time.thread_time() - thread_start
    child_cpu = _cpu_s(child.process.pid) - child_start if child is not None else 0.0
    undecided = 0 if runtime is None else _undecided(tally, steps - 1)
    guard.close()
    if runtime is not None:
        runtime.close()
    n = steps - warm
    # The trainer's process = the training thread + the guard's and the bridge's threads.
    return {
        "steps_per_s": n / wall,
        "cpu_us_per_step": 1e6 * cpu / n,
        "thread_cpu_us_per_step": 1e6 * thread / n,
        "background_cpu_us_per_step": 1e6 * (cpu - thread) / n,
        "child_cpu_us_per_step": 1e6 * child_cpu / n,
        "undecided_at_end": undecided,
        "startup_s": child.startup_s if child is not None else 0.0,
    }


def paired(steps: int, block: int, directory: str) -> dict:
    """The default layout against ``unpublished`` in alternating blocks of one process (see above)."""
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    runtime = open_runtime(load_settings({}))
    loops = {}
    for kind in ("unpublished", "process"):
        model, opt, x, y = make()
        config = GuardConfig(
            checkpoint_dir=f"{directory}/paired-{kind}", checkpoint_every=0, resume=False
        )
        guard = (
            Guard(model, opt, run_id="paired-unpublished", config=config, connect=False)
            if kind == "unpublished"
            else Guard(
                model,
                opt,
                run_id="paired-process",
                config=config,
                runtime=runtime,
            )
        )
        loops[kind] = (guard, model, opt, x, y)
    tally = DecisionTally(loops["process"][0])
    wall = dict.fromkeys(loops, 0.0)
    thread = dict.fromkeys(loops, 0.0)
    blocks = max(2, steps // block)
    warm = max(1, blocks // 10)
    for b in range(blocks):
        for kind in tuple(loops) if b % 2 == 0 else tuple(reversed(loops)):
            guard, model, opt, x, y = loops[kind]
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(block):
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                guard.step(loss)
            if b >= warm:
                wall[kind] += time.perf_counter() - start
                thread[kind] += time.thread_time() - cpu
    guard = loops["process"][0]
    guard.publisher.flush(30.0)
    dropped = guard.publisher.dropped
    total = blocks * block
    behind = _undecided(tally, total - 1)  # the pipeline's lag when the loop ended
    # Missed: steps never decided, once the pipeline had a bounded while to catch up.
    deadline = time.monotonic() + 120.0
    while len(never := _never_decided(tally, total)) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    # The default layout or not: where no child could start, this measured threads.
    child = child_pipeline(runtime)
    layout = "threads" if child is None else "child" if child.problem is None else "child died"
    for guard, *_ in loops.values():
        guard.close()
    runtime.close()
    counted = (blocks - warm) * block
    return {
        "ratio": wall["unpublished"] / wall["process"],
        "hook_share": thread["process"] / thread["unpublished"] - 1.0,
        "steps_per_s": {k: counted / v for k, v in wall.items()},
        "thread_cpu_us_per_step": {k: 1e6 * v / counted for k, v in thread.items()},
        "missed": len(never) / total,
        "dropped": dropped,
        "never_decided": len(never),
        "undecided_at_end": behind,
        "steps": total,
        "block": block,
        "layout": layout,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=50, help="steps per block of the paired run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: dict[str, list[dict]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        pairs = paired(args.steps * max(1, args.rounds), args.block, tmp)
        if args.rounds == 0:  # the paired run alone
            print(json.dumps({"paired": pairs}) if args.json else json.dumps(pairs, indent=1))
            return
        for r in range(args.rounds):
            for kind in KINDS if r % 2 == 0 else tuple(reversed(KINDS)):
                results[kind].append(run(kind, args.steps, f"{tmp}/{kind}-{r}"))
    report: dict = {
        k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in results.items()
    }
    base = results["unpublished"]
    for kind, name in (("threads", "ratio"), ("process", "ratio_process")):
        rounds = [w["steps_per_s"] / b["steps_per_s"] for w, b in zip(results[kind], base)]
        cpu = [b["cpu_us_per_step"] / w["cpu_us_per_step"] for w, b in zip(results[kind], base)]
        report[name] = statistics.median(rounds)
        report[f"{name}_range"] = [min(rounds), max(rounds)]
        # The trainer's own CPU per step, unpublished / with: what the pipeline takes from this process.
        report[f"cpu_{name}"] = statistics.median(cpu)
        # The hook's cost in the training thread: its extra CPU per step over unpublished, as a
        # share of unpublished's step time (aim < 2 %).
        hook = [
            (w["thread_cpu_us_per_step"] - b["thread_cpu_us_per_step"]) * b["steps_per_s"] / 1e6
            for w, b in zip(results[kind], base)
        ]
        report[f"hook_{name}"] = statistics.median(hook)
    report["steps"], report["rounds"] = args.steps, args.rounds
    report["paired"] = pairs
    if args.json:
        print(json.dumps(report))
        return
    for kind in KINDS:
        row = report[kind]
        child = (
            f"  child {row['child_cpu_us_per_step']:5.0f} µs CPU/step" if kind == "process" else ""
        )
        print(
            f"{kind:12s} {row['steps_per_s']:7.0f} steps/s  trainer {row['cpu_us_per_step']:5.0f} "
            f"µs CPU/step (training thread {row['thread_cpu_us_per_step']:4.0f}, other threads "
            f"{row['background_cpu_us_per_step']:4.0f}){child}  "
            f"undecided at end {row['undecided_at_end']:.0f}"
        )
    for kind, name in (("threads", "ratio"), ("process", "ratio_process")):
        low, high = report[f"{name}_range"]
        print(
            f"{kind}/unpublished: {report[name]:.2f} (rounds {low:.2f}-{high:.2f}; aim >= 0.9); "
            f"trainer CPU {report[f'cpu_{name}']:.2f}; hook in the training thread "
            f"{100 * report[f'hook_{name}']:+.1f}% of a step (aim < 2%)"
        )
    print(f"child start-up {report['process']['startup_s']:.1f} s")
    rates = pairs["steps_per_s"]
    print(
        f"paired blocks of {pairs['block']} ({pairs['steps']} steps each): default/unpublished "
        f"{pairs['ratio']:.2f} ({rates['process']:.0f} / {rates['unpublished']:.0f} steps/s; aim >= 0.9); "
        f"hook {100 * pairs['hook_share']:+.1f}% of the training thread's CPU (aim < 2%); "
        f"missed {100 * pairs['missed']:.1f}% (never decided; {pairs['dropped']} dropped by the queue; "
        f"{pairs['undecided_at_end']} behind when the loop ended; aim < 2%)"
    )


if __name__ == "__main__":
    main()
