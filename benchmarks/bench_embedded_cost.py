"""What the embedded pipeline costs the trainer: step rate with it vs with publishing off.

Two loops on the same tiny CPU model, interleaved in rounds so that machine
noise hits them alike:

- ``unpublished``: ``Guard(..., connect=False)``: the guard's local work
  (statistics, the local skip rule) and nothing on any bus;
- ``embedded``: ``Guard(...)`` as a user writes it: the in-process bus and
  the whole pipeline (four detectors, fusion, actuator) as threads of the
  trainer's process;
- ``process``: the same with ``worker.embedded_process``: the pipeline's
  workers in a child process bridged to the trainer's bus (its lag is the
  bridge's: steps not yet handed to the child).

Reported: steps/s and CPU time in the trainer's process per step of each
(median over rounds), the ratios to ``unpublished`` (aim >= 0.9),
and how far the pipeline was behind when the loop ended (records the
detectors had not yet committed): a pipeline that keeps up costs less than
one that is dropping behind, so the ratio is only honest with the lag beside it.

    python benchmarks/bench_embedded_cost.py [--steps 2000] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from torch import nn

from spikeguard.producers import Guard, GuardConfig


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    return model, opt, x, y


def _lag(guard: Guard) -> int:
    """Step records the slowest detector had not committed (embedded bus only)."""
    bus = guard.bus
    if bus is None or not hasattr(bus, "_groups"):
        return 0
    from spikeguard.metrics_http import embedded_lag

    steps = guard.topics.steps
    return max((n for (group, topic, _), n in embedded_lag(bus).items() if topic == steps), default=0)


def run(kind: str, steps: int, directory: str) -> dict:
    model, opt, x, y = make()
    runtime = None
    if kind == "process":
        from spikeguard.runtime import open_runtime
        from spikeguard.settings import load_settings

        runtime = open_runtime(load_settings({"worker": {"embedded_process": True}}))
        config = GuardConfig(checkpoint_dir=directory, checkpoint_every=0, resume=False,
                             signing_key=runtime.settings.signing_key)
        guard = Guard(model, opt, run_id=f"cost-{kind}", config=config, bus=runtime.bus,
                      topics=runtime.topics)
    else:
        config = GuardConfig(checkpoint_dir=directory, checkpoint_every=0, resume=False)
        guard = Guard(model, opt, run_id=f"cost-{kind}", config=config, connect=(kind == "embedded"))
    warm = max(1, steps // 10)
    for i in range(steps):
        if i == warm:
            start, cpu_start = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.step(loss)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    lag = _lag(guard)
    guard.close()
    if runtime is not None:
        runtime.close()
    return {"steps_per_s": (steps - warm) / wall, "cpu_us_per_step": 1e6 * cpu / (steps - warm), "lag": lag}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kinds = ("unpublished", "embedded", "process")
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in kinds if r % 2 == 0 else tuple(reversed(kinds)):
                results[kind].append(run(kind, args.steps, f"{tmp}/{kind}-{r}"))
    report = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in results.items()}
    base = report["unpublished"]
    report["ratio"] = report["embedded"]["steps_per_s"] / base["steps_per_s"]
    report["ratio_process"] = report["process"]["steps_per_s"] / base["steps_per_s"]
    # The trainer's own CPU per step, unpublished / with: what the pipeline takes from this process.
    report["cpu_ratio"] = base["cpu_us_per_step"] / report["embedded"]["cpu_us_per_step"]
    report["cpu_ratio_process"] = base["cpu_us_per_step"] / report["process"]["cpu_us_per_step"]
    report["steps"], report["rounds"] = args.steps, args.rounds
    if args.json:
        print(json.dumps(report))
    else:
        for kind in kinds:
            row = report[kind]
            print(f"{kind:12s} {row['steps_per_s']:9.0f} steps/s  "
                  f"{row['cpu_us_per_step']:7.0f} µs CPU/step  "
                  f"lag at end {row['lag']:.0f}")
        print(f"ratio embedded/unpublished: {report['ratio']:.2f}, process/unpublished: "
              f"{report['ratio_process']:.2f} (aim >= 0.9); CPU in the trainer's process "
              f"{report['cpu_ratio']:.2f} and {report['cpu_ratio_process']:.2f}")


if __name__ == "__main__":
    main()
