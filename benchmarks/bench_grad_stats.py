"""The Guard's gradient statistics against ``clip_grad_norm_`` alone, on the same models.

    python benchmarks/bench_grad_stats.py [--rounds 9] [--calls 300] [--threads 1] [--json PATH]
        [--against GIT_REF]

Per model (small CPU models: the guard-overhead MLP, a deeper one with many
small tensors, a transformer encoder), on the same gradients:

- ``stats``: ``GradStats.compute(loss)`` as the Guard runs it (total norm,
  top-k layer norms, the loss, one ``tolist()`` to the host);
- ``clip``: ``torch.nn.utils.clip_grad_norm_(params, 1.0)`` alone (what it
  costs a loop that clips without looking at the norm);
- ``clip+item``: the same and ``.item()`` on the norm (a loop that logs it);
- ``norm``: ``torch.nn.utils.get_total_norm(grads)`` and ``.item()``: the
  norm alone, without the scaling clip does (the stricter yardstick).

The three run in turn within each round (order alternating), ``--calls``
calls each, and the figure is the median over rounds of each call's median
time, so machine noise hits them alike. Host reads of tensor values
(``item``/``tolist``/``cpu``/``numpy``/``float``...) are counted per call.
``--against REF`` adds ``stats@REF``: ``producers/stats.py`` as it was at the
git ref REF, run in turn with the others, to read a change to the statistics
as before and after in one process.
Aim: stats <= 1.5x clip, and exactly one transfer per step.
A benchmark: it reports, it does not fail.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from spikeguard.producers.stats import GradStats

AIM_RATIO = 1.5
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


def mlp(width: int = 256, depth: int = 3) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The model of bench_guard_overhead.py."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(256 if i == 0 else width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    return model, lambda: nn.functional.cross_entropy(model(x), y)


def deep(width: int = 64, depth: int = 48) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """Many small tensors: where per-parameter work would show."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    x, y = torch.randn(32, width), torch.randn(32, 1)
    return model, lambda: nn.functional.mse_loss(model(x), y)


def encoder(width: int = 128, layers: int = 4) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
    x = torch.randn(8, 32, width)
    return model, lambda: model(x).pow(2).mean()


MODELS = {"mlp": mlp, "deep": deep, "encoder": encoder}


class Reads:
    """Host reads of tensor values, counted while patched in."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._originals = {name: getattr(torch.Tensor, name) for name in READS}

    def __enter__(self) -> "Reads":
        for name, original in self._originals.items():

            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                self.counts[_name] += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)


def stats_at(ref: str) -> Any:
    """``producers/stats.py`` as it was at the git ref ``ref``, as a module of its own."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{ref}:producers/stats.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    module = types.ModuleType(f"stats_at_{ref}")
    module.__dict__["__name__"] = module.__name__
    sys.modules[module.__name__] = module  # dataclasses look their module up by name
    exec(compile(source, f"{ref}:producers/stats.py", "exec"), module.__dict__)
    return module


def measure(name: str, rounds: int, calls: int, against: tuple[str, Any] | None = None) -> dict:
    torch.manual_seed(0)
    model, loss_fn = MODELS[name]()
    loss = loss_fn()
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    grads: list[torch.Tensor] = []  # the same tensors throughout: clipping scales them in place
    for p in params:
        assert p.grad is not None  # loss.backward() gave every trainable parameter one
        grads.append(p.grad)
    saved = [g.clone() for g in grads]  # clipping scales the gradients: put them back
    stats = GradStats(list(model.named_parameters()), top_k=5)

    def restore() -> None:
        for g, s in zip(grads, saved):
            g.copy_(s)

    def clip_item() -> None:
        nn.utils.clip_grad_norm_(params, 1.0).item()

    kinds: dict[str, Callable[[], object]] = {
        "stats": lambda: stats.compute(loss),
        "clip": lambda: nn.utils.clip_grad_norm_(params, 1.0),
        "clip+item": clip_item,
    }
    if against is not None:
        ref, module = against
        old = module.GradStats(list(model.named_parameters()), top_k=5)
        kinds[f"stats@{ref}"] = lambda: old.compute(loss)
    if hasattr(nn.utils, "get_total_norm"):  # torch >= 2.6
        kinds["norm"] = lambda: nn.utils.get_total_norm(grads).item()
    reads = {}
    for kind, fn in kinds.items():
        with Reads() as counter:
            fn()
        reads[kind] = sum(counter.counts.values())
        restore()
    medians: dict[str, list[float]] = {kind: [] for kind in kinds}
    for r in range(rounds):
        order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
        for kind in order:
            fn, times = kinds[kind], []
            for _ in range(calls):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
                if kind.startswith("clip"):
                    restore()
            medians[kind].append(statistics.median(times))
    us = {kind: statistics.median(v) * 1e6 for kind, v in medians.items()}
    return {
        "tensors": len(params),
        "parameters": sum(p.numel() for p in params),
        "us": us,
        "stats_over_clip": us["stats"] / us["clip"],
        "stats_over_clip_item": us["stats"] / us["clip+item"],
        "stats_over_norm": us["stats"] / us["norm"] if "norm" in us else None,
        "host_reads_per_call": reads,
    }


def render(report: dict) -> str:
    lines = [
        f"gradient statistics vs clip_grad_norm_, {report['threads']} thread(s), "
        f"medians of {report['rounds']} rounds x {report['calls']} calls"
    ]
    lines.append(
        f"{'model':<8} {'tensors':>7} {'stats µs':>9} {'clip µs':>8} {'clip+item':>9} "
        f"{'norm µs':>8} {'stats/clip':>10} {'stats/norm':>10}  reads/step  status"
    )
    for name, r in report["models"].items():
        ratio = r["stats_over_clip"]
        ok = ratio <= AIM_RATIO and r["host_reads_per_call"]["stats"] == 1
        lines.append(
            f"{name:<8} {r['tensors']:>7} {r['us']['stats']:>9.1f} {r['us']['clip']:>8.1f} "
            f"{r['us']['clip+item']:>9.1f} {r['us'].get('norm', float('nan')):>8.1f} {ratio:>9.2f}x "
            f"{r['stats_over_norm'] or float('nan'):>9.2f}x  {r['host_reads_per_call']['stats']:>10}  "
            f"{'ok' if ok else 'MISSES AIM'}"
        )
    lines.append(f"aim: stats <= {AIM_RATIO}x clip, one host read per step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--against", metavar="GIT_REF", help="also time stats.py as at this ref")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    against = (args.against, stats_at(args.against)) if args.against else None
    report = {
        "threads": args.threads,
        "rounds": args.rounds,
        "calls": args.calls,
        "torch": torch.__version__,
        "models": {name: measure(name, args.rounds, args.calls, against) for name in args.models},
    }
    print(render(report))
    if against is not None:
        ref = against[0]
        for name, r in report["models"].items():
            print(
                f"{name:<8} stats {r['us']['stats']:.1f} µs against {r['us'][f'stats@{ref}']:.1f} "
                f"at {ref} ({r['us']['stats'] / r['us'][f'stats@{ref}']:.2f}x)"
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
