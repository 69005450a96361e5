"""Issue 41's embedded rows: a user's own loop, unguarded, against the same loop guarded by default.

Three models, as a new user would try them (torch's default thread count, CPU):

- ``mlp``: a batch-32 MLP with SGD, about 0.5 ms per unguarded step;
- ``adamw``: a wider batch-32 MLP with AdamW, about 1.7 ms per step;
- ``chargpt``: a two-layer character transformer with AdamW, about 10 ms per step.

For each model four loops, each with its own copy of the model, step in
alternating blocks of one process (the order turns every round), so that a
loaded machine's noise falls on all alike:

- ``unguarded``: the plain loop, no spikeguard at all: the baseline;
- ``handoff``: the plain loop plus the bare hand-off the embedded pipeline
  cannot do without: each step's loss read to the host (the one ``.item()``)
  and kept, every 32 steps the batch put on a ``multiprocessing`` queue (its
  feeder thread pickles and writes it) read and dropped by a child process.
  Its ratio is the best the embedded pipeline can reach on this machine;
- ``limit``: the hand-off plus what the Guard cannot avoid on the training
  thread: the gradient norm read with the loss (one fused norm kernel, one
  stack, the loss and the norm brought to the host together: the one
  transfer) and kept beside the loss. Its ratio is the limit of the trainer's
  side: a guarded row cannot beat it, whatever the Guard's own Python costs;
- ``guarded``: ``Guard(model, opt)`` on the default runtime (the pipeline in
  a child process);
- with ``--against REF``, ``guarded@REF``: the same, with spikeguard as it was
  at the git ref REF (package_at.py: imported beside this one under another
  name, on a runtime of its own), for a before/after against the same limit
  in one run.

Reported per model: the median over rounds of each round's ratio to
``unguarded`` (a round is one block of each loop), their range, the step
rates, guarded against ``limit`` (the median of each round's guarded rate over
its limit rate), and the guarded run's steps never decided once the pipeline
had a bounded while to catch up.

``--clock thread`` times each block by the training thread's CPU clock
instead of the wall, with torch on that one thread: the training thread's
own cost, which a loaded machine's queue for the CPU does not blur (the
publisher's and the child's CPU are then not counted: they are the
pipeline's, not the trainer's).

    python benchmarks/bench_embedded_models.py [--models mlp adamw chargpt] [--rounds 7]
        [--seconds 1.0] [--clock wall|thread] [--against GIT_REF] [--json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
from torch import nn

from decision_tally import DecisionTally

from spikeguard.producers import Guard, GuardConfig

#: A step of a loop: runs one optimizer step and returns its loss.
Step = Callable[[], torch.Tensor]


def _mlp(width: int, depth: int, optimizer: str) -> tuple[nn.Module, Any, Step]:
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    opt: Any = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.01)
    )
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return model, opt, step


class CharGPT(nn.Module):
    """A small causal character transformer (vocabulary 65, context 64)."""

    def __init__(self, vocab: int = 65, context: int = 64, width: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.mask = nn.Transformer.generate_square_subsequent_mask(context)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def _chargpt() -> tuple[nn.Module, Any, Step]:
    model = CharGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(0, 65, (16, 65))

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 65), tokens[:, 1:].reshape(-1))
        loss.backward()
        return loss

    return model, opt, step


#: name -> a builder of (model, optimizer, one step); sized for ~0.5, ~1.7 and ~10 ms per step.
MODELS: dict[str, Callable[[], tuple[nn.Module, Any, Step]]] = {
    "mlp": lambda: _mlp(128, 2, "sgd"),
    "adamw": lambda: _mlp(512, 3, "adamw"),
    "chargpt": _chargpt,
}


#: The clock blocks are timed by: the wall, or the training thread's CPU (``--clock thread``).
CLOCK: list[Callable[[], float]] = [time.perf_counter]

#: Steps the bare hand-off sends at once: one wake-up of the feeder thread and the child per batch.
HANDOFF_BATCH = 32


def _drain(queue: Any) -> None:
    """The hand-off's child: read each step's numbers and drop them, until ``None``."""
    while queue.get() is not None:
        pass


def read_loss_and_norm(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> list[float]:
    """The least the Guard reads per step: the loss and the gradients' total norm, one transfer."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch.stack(list(torch._foreach_norm(grads))).float()
    total = torch.linalg.vector_norm(norms).reshape(1)
    return torch.cat([loss.detach().float().reshape(1), total]).tolist()


class Loop:
    """One of the four loops of a model: its own copy, its step, and what runs after it."""

    def __init__(
        self, kind: str, model_name: str, runtime: Any, queue: Any, tmp: str, package: Any = None
    ) -> None:
        torch.manual_seed(0)
        self.kind = kind
        self.model, self.opt, self.step = MODELS[model_name]()
        self.queue = queue
        self.params = list(self.model.parameters())
        self.pending: list[tuple[int, Any]] = []
        self.n = 0
        self.guard = None
        self.decided: DecisionTally | None = None
        if kind == "guarded":
            config = GuardConfig(
                checkpoint_dir=f"{tmp}/{model_name}", checkpoint_every=0, resume=False
            )
            self.guard = Guard(
                self.model, self.opt, run_id=f"bench-{model_name}", config=config, runtime=runtime
            )
            self.decided = DecisionTally(self.guard)
        elif kind.startswith("guarded@"):  # the package as at a ref (its producers), on its runtime
            producers = package
            config = producers.GuardConfig(
                checkpoint_dir=f"{tmp}/{model_name}-at-ref", checkpoint_every=0, resume=False
            )
            self.guard = producers.Guard(
                self.model,
                self.opt,
                run_id=f"bench-{model_name}-at-ref",
                config=config,
                runtime=runtime,
            )

    def block(self, steps: int) -> float:
        """Run ``steps`` steps; the seconds they took on the chosen clock."""
        start = CLOCK[0]()
        for _ in range(steps):
            loss = self.step()
            if self.guard is not None:
                self.guard.step(loss)
            else:
                read: Any = None
                if self.kind == "limit":
                    read = read_loss_and_norm(loss, self.params)
                elif self.queue is not None:
                    read = loss.item()
                self.opt.step()
                if self.queue is not None:
                    self.pending.append((self.n, read))
                    if len(self.pending) >= HANDOFF_BATCH:
                        self.queue.put(self.pending)
                        self.pending = []
            self.n += 1
        return CLOCK[0]() - start


def _never_decided(tally: DecisionTally, steps: int, wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    while True:
        missing = steps - len(tally.update() & set(range(steps)))
        if missing == 0 or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


def measure(
    model_name: str,
    rounds: int,
    seconds: float,
    runtime: Any,
    min_steps: int = 50,
    against: tuple[str, Any, Any] | None = None,
) -> dict[str, Any]:
    """One model's four loops in alternating blocks of about ``seconds`` (at least ``min_steps``)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    drain = ctx.Process(target=_drain, args=(queue,), daemon=True)
    drain.start()
    with tempfile.TemporaryDirectory() as tmp:
        loops = {
            "unguarded": Loop("unguarded", model_name, runtime, None, tmp),
            "handoff": Loop("handoff", model_name, runtime, queue, tmp),
            "limit": Loop("limit", model_name, runtime, queue, tmp),
            "guarded": Loop("guarded", model_name, runtime, None, tmp),
        }
        if against is not None:
            ref, producers, ref_runtime = against
            loops[f"guarded@{ref}"] = Loop(
                f"guarded@{ref}", model_name, ref_runtime, None, tmp, producers
            )
        # Warm-up, and the block size: about ``seconds`` of the unguarded loop.
        for loop in loops.values():
            loop.block(20)
        per_step = loops["unguarded"].block(50) / 50
        steps = max(min_steps, int(seconds / per_step))
        walls: dict[str, list[float]] = {k: [] for k in loops}
        for r in range(rounds):
            order = list(loops) if r % 2 == 0 else list(reversed(loops))
            order = order[r % len(order) :] + order[: r % len(order)]
            for kind in order:
                walls[kind].append(loops[kind].block(steps))
        guard = loops["guarded"].guard
        assert guard is not None
        guard.publisher.flush(30.0)
        tally = loops["guarded"].decided
        assert tally is not None
        never = _never_decided(tally, loops["guarded"].n, 60.0)
        tally.close()
        for loop in loops.values():
            if loop.guard is not None:
                loop.guard.close()
    queue.put(None)
    drain.join(10)
    result: dict[str, Any] = {
        "ms_per_step_unguarded": 1e3 * statistics.median(walls["unguarded"]) / steps,
        "steps_per_block": steps,
        "rounds": rounds,
        "steps_per_s": {k: steps / statistics.median(v) for k, v in walls.items()},
        "guarded_steps": loops["guarded"].n,
        "never_decided": never,
    }
    guarded = ["guarded"] + ([f"guarded@{against[0]}"] if against is not None else [])
    for kind in ("handoff", "limit", *guarded):
        ratios = [b / w for w, b in zip(walls[kind], walls["unguarded"])]
        result[f"ratio_{kind}"] = statistics.median(ratios)
        result[f"ratio_{kind}_range"] = [min(ratios), max(ratios)]
    # The guarded loop against the trainer's limit, round by round (rate over rate).
    for kind in guarded:
        to_limit = [limit / g for g, limit in zip(walls[kind], walls["limit"])]
        result[f"{kind}_to_limit"] = statistics.median(to_limit)
        result[f"{kind}_to_limit_range"] = [min(to_limit), max(to_limit)]
    if against is not None:  # this checkout's guarded rate over the ref's, round by round
        result["guarded_over_ref"] = statistics.median(
            [b / w for w, b in zip(walls["guarded"], walls[f"guarded@{against[0]}"])]
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--rounds", type=int, default=7, help="rounds of one block per loop")
    parser.add_argument("--seconds", type=float, default=1.0, help="about how long a block runs")
    parser.add_argument(
        "--min-steps", type=int, default=50, help="steps per block at least (a loaded machine)"
    )
    parser.add_argument(
        "--clock",
        choices=["wall", "thread"],
        default="wall",
        help="time blocks by the wall, or by the training thread's CPU (torch on one thread)",
    )
    parser.add_argument(
        "--against", metavar="GIT_REF", help="also a guarded loop of spikeguard as at this ref"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.clock == "thread":
        CLOCK[0] = time.thread_time
        torch.set_num_threads(1)
    from spikeguard.runtime import open_runtime
    from spikeguard.settings import load_settings

    runtime = open_runtime(load_settings({}))
    layout = "threads" if runtime.child is None else "child"
    against = None
    if args.against:
        from package_at import package_at

        package = package_at(args.against)
        producers = importlib.import_module(f"{package.__name__}.producers")
        runtime_module = importlib.import_module(f"{package.__name__}.runtime")
        settings_module = importlib.import_module(f"{package.__name__}.settings")
        # (the ref's Guard goes on a runtime of its own: its pipeline is the ref's too)
        ref_runtime = runtime_module.open_runtime(settings_module.load_settings({}))
        against = (args.against, producers, ref_runtime)
    try:
        report: dict[str, Any] = {
            name: measure(name, args.rounds, args.seconds, runtime, args.min_steps, against)
            for name in args.models
        }
    finally:
        runtime.close()
        if against is not None:
            against[2].close()
    report["layout"], report["torch_threads"] = layout, torch.get_num_threads()
    report["clock"] = args.clock
    if args.json:
        print(json.dumps(report))
        return 0
    for name in args.models:
        row = report[name]
        rates = row["steps_per_s"]
        print(
            f"{name:8s} {row['ms_per_step_unguarded']:6.2f} ms/step unguarded; guarded "
            f"{row['ratio_guarded']:.2f}x (rounds {row['ratio_guarded_range'][0]:.2f}-"
            f"{row['ratio_guarded_range'][1]:.2f}), bare hand-off {row['ratio_handoff']:.2f}x, "
            f"trainer's limit {row['ratio_limit']:.2f}x; guarded {row['guarded_to_limit']:.2f}x "
            f"its limit (rounds {row['guarded_to_limit_range'][0]:.2f}-"
            f"{row['guarded_to_limit_range'][1]:.2f}); {rates['unguarded']:.0f} / "
            f"{rates['handoff']:.0f} / {rates['limit']:.0f} / {rates['guarded']:.0f} steps/s; "
            f"{row['never_decided']} of {row['guarded_steps']} never decided"
        )
        if args.against:
            at = f"guarded@{args.against}"
            print(
                f"{'':8s} {at}: {row[f'ratio_{at}']:.2f}x (rounds {row[f'ratio_{at}_range'][0]:.2f}-"
                f"{row[f'ratio_{at}_range'][1]:.2f}); {row[f'{at}_to_limit']:.2f}x its limit "
                f"(rounds {row[f'{at}_to_limit_range'][0]:.2f}-{row[f'{at}_to_limit_range'][1]:.2f}); "
                f"{rates[at]:.0f} steps/s; this checkout over it, round by round: "
                f"{row['guarded_over_ref']:.2f}x"
            )
    print(f"layout {layout}, torch threads {torch.get_num_threads()}, clock {args.clock}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
