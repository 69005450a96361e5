"""What the guard costs per training step, measured in one run.

Three loops on the same small CPU model, interleaved in rounds so that machine
noise hits them alike, median per-step time of each:

- ``plain``: zero_grad, forward, backward, optimizer.step;
- ``plain+norm``: the same plus the gradient-norm computation a careful loop
  does anyway (``clip_grad_norm_(..., inf)`` and one ``.item()`` to log it);
- ``guarded``: the plain loop with ``guard.step(loss)`` in place of
  ``optimizer.step()`` — statistics with one transfer, action check, the
  StepEvent handed to the background publisher of a real embedded bus.
  Periodic checkpoints are off (their cost is per checkpoint, not per step).
- ``guarded-no-norms``: the same with ``update_norm`` and ``param_norm`` off;
  the difference to ``guarded`` is what those two norms cost.

The ``direct`` figure is the steadiest: within the same guarded steps, the
time of ``guard.step`` minus the optimizer update it runs, against the time
of the norm computation alone in the plain+norm steps.

Aim: guarded - plain+norm < 100 µs per step, and < 2 % of the step time.
Wall time (median per step) and process CPU time (per step, background
threads included — the steadier figure on a shared machine) are both reported.

    python benchmarks/bench_guard_overhead.py [--steps 300] [--rounds 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from torch import nn

from spikeguard.bus import EmbeddedBus
from spikeguard.producers import Guard, GuardConfig


def make(seed: int = 0, width: int = 256, depth: int = 3, batch: int = 64):
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(256 if i == 0 else width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, 256), torch.randint(0, 10, (batch,))
    return model, opt, x, y


GUARD_OWN: dict[
    str, list[float]
] = {}  # per guarded kind and step: guard.step minus its optimizer.step
NORM_OWN: list[float] = []  # per step: clip_grad_norm_(inf) + .item() alone


SKIP_OUTLIERS = True  # the Guard's default


def _loop(kind: str, steps: int, guard_dir: str) -> tuple[float, float]:
    """(median wall seconds per step, process CPU seconds per step — background threads included)."""
    model, opt, x, y = make()
    bus = guard = None
    if kind.startswith("guarded"):
        norms = kind == "guarded"
        bus = EmbeddedBus()
        guard = Guard(
            model,
            opt,
            run_id="bench",
            bus=bus,
            config=GuardConfig(
                checkpoint_dir=guard_dir,
                checkpoint_every=0,
                resume=False,
                skip_outliers=SKIP_OUTLIERS,
                update_norm=norms,
                param_norm=norms,
            ),
        )
        guard.halves.started = True  # no initial checkpoint inside the timed loop
    times, inner, norm_times = [], [], []
    mark: dict[str, float] = {}
    opt.register_step_pre_hook(lambda *a: mark.__setitem__("t", time.perf_counter()))
    opt.register_step_post_hook(lambda *a: inner.append(time.perf_counter() - mark["t"]))
    warm = steps // 10
    for i in range(steps):
        if i == warm:
            cpu_start = time.process_time()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        t_step = time.perf_counter()
        if guard is not None:
            guard.step(loss)
        else:
            if kind == "plain+norm":
                norm = nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
                norm.item()
                norm_times.append(time.perf_counter() - t_step)
            opt.step()
        end = time.perf_counter()
        times.append(end - start)
        if guard is not None:  # guard.step's own time: its call minus the optimizer update inside
            GUARD_OWN.setdefault(kind, []).append(end - t_step - inner[-1])
        elif kind == "plain+norm":
            NORM_OWN.append(norm_times[-1])
    if guard is not None:
        guard.publisher.flush(5.0)  # the sender thread's work counts too
    cpu = (time.process_time() - cpu_start) / (steps - warm)
    if guard is not None:
        guard.close()
    if bus is not None:  # made with the guard
        bus.close()
    return statistics.median(times[warm:]), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--no-skip-rule",
        action="store_true",
        help="measure without the local outlier skip rule (its cost is the difference)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global SKIP_OUTLIERS
    SKIP_OUTLIERS = not args.no_skip_rule
    kinds = ("plain", "plain+norm", "guarded", "guarded-no-norms")
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in kinds if r % 2 == 0 else reversed(kinds):
                w, c = _loop(kind, args.steps, tmp)
                wall[kind].append(w)
                cpu[kind].append(c)
    report: dict = {"params": sum(p.numel() for p in make()[0].parameters())}
    own, norm = statistics.median(GUARD_OWN["guarded"]), statistics.median(NORM_OWN)
    bare = statistics.median(GUARD_OWN["guarded-no-norms"])
    step = statistics.median(wall["plain"])
    report["direct"] = {
        "guard_own_us": own * 1e6,
        "norm_only_us": norm * 1e6,
        "beyond_norm_us": (own - norm) * 1e6,
        "pct_of_step": 100 * own / step,
        # the update and parameter norms (update_norm.py): guarded minus guarded-no-norms
        "update_param_norms_us": (own - bare) * 1e6,
        "update_param_norms_pct_of_step": 100 * (own - bare) / step,
    }
    for label, table in (("wall", wall), ("cpu", cpu)):
        med = {k: statistics.median(v) for k, v in table.items()}
        report[label] = {
            "step_us": {k: v * 1e6 for k, v in med.items()},
            "overhead_us": (med["guarded"] - med["plain"]) * 1e6,
            "overhead_pct": 100 * (med["guarded"] - med["plain"]) / med["plain"],
            "beyond_norm_us": (med["guarded"] - med["plain+norm"]) * 1e6,
            "beyond_norm_pct": 100 * (med["guarded"] - med["plain+norm"]) / med["plain+norm"],
            "update_param_norms_us": (med["guarded"] - med["guarded-no-norms"]) * 1e6,
        }
    if args.json:
        print(json.dumps(report))
        return
    print(f"model: {report['params']} parameters, {args.threads} thread(s)")
    d = report["direct"]
    print(
        f"direct (same steps): guard.step's own time {d['guard_own_us']:.1f} µs/step "
        f"({d['pct_of_step']:.2f} % of a plain step); the norm computation alone {d['norm_only_us']:.1f} µs; "
        f"beyond it {d['beyond_norm_us']:.1f} µs"
    )
    print(
        f"of which the update and parameter norms: {d['update_param_norms_us']:.1f} µs/step "
        f"({d['update_param_norms_pct_of_step']:.2f} % of a plain step)"
    )
    for label in ("wall", "cpu"):
        r = report[label]
        steps = "  ".join(f"{k} {v:8.1f} µs" for k, v in r["step_us"].items())
        print(f"{label:>4} per step: {steps}")
        print(
            f"     guard overhead: {r['overhead_us']:.1f} µs ({r['overhead_pct']:.2f} %); beyond the "
            f"norm computation: {r['beyond_norm_us']:.1f} µs ({r['beyond_norm_pct']:.2f} %)"
        )


if __name__ == "__main__":
    main()
