"""Three small loops a new user might guard, each clean, faulty unguarded and faulty guarded.

    python benchmarks/bench_user_loops.py [--loops char_lm,seq2seq,cnn] [--faults data,lr_blowup]
                                          [--steps 2000] [--seeds 10] [--seed FIRST] [--jobs J]
                                          [--decay-share 0.1] [--no-same-data] [--json]
                                          [--runs runs.jsonl] [--from-runs runs.jsonl]
                                          [--no-lockstep]

The loops are kinds the recovery benchmark (a small transformer) does not
have: a character-level GRU language model, a GRU encoder-decoder that
reverses digit strings, and a small CNN on 8x8 digit images (scikit-learn's
digits, bundled with it). Each is guarded with the README's five lines and
the defaults (lockstep, so one seed gives one result), reading the loader in
the order the unguarded loop reads it: a guarded run that takes no action ends
with the unguarded run's weights to the bit, and any gap is what it did. The faults, keyed by
global batch index or step so every mode meets the same ones:

=============  =================================================================
``data``       ``bad_batches`` consecutive batches from ``fault_step`` whose
               targets are shuffled across the batch (the inputs no longer
               predict them)
``lr_blowup``  the LR x``lr_factor`` for ``lr_steps`` steps from ``fault_step``,
               inside the schedule (a rollback replays it, as a mis-set
               schedule would)
=============  =================================================================

Reported per loop and fault, paired by seed (a seed fixes the weights, the data
order and the fault, so its clean, unguarded and guarded runs meet the same
run): the median final eval loss of each, and over seeds the median and range
of guarded / clean and guarded / unguarded, how many seeds the guarded run
ends below, equal to and above the unguarded one (with a two-sided sign test),
the largest share of the run's batches skipped and the most steps re-run. The
``same data / clean`` column is the loop's own noise: the unguarded loop
reading exactly the batches the guarded run kept (those it skipped left out,
and no update made where it skipped one). A rollback that restores everything
ends there to the bit, so on a data fault whose bad batches were all skipped
it is the clean loop without those batches, and its spread is how far leaving
a few batches out moves this loop's eval with no Guard at all. A second table
gives the same for the eval averaged over the last ``tail_share`` of the run
(every ``tail_every`` steps).

The LR decays to 0.1x over the last tenth of the run (``--decay-share``), as a
user's schedule would end: at a constant LR the seq2seq loop's eval swings by
tens of % from one 25-step point to the next late in the run, and leaving any
8 batches out moved its final eval by -20 to +84 % (issue 38), so a last-step
gap was mostly that swing. ``--decay-share 0`` is the constant schedule of the
earlier figures and of the quick tests (``LoopConfig()``). The aims (issue
38): a data fault costs at most ``max_skip_share`` of the run and ends within
3 % of clean; no guarded run ends worse than unguarded. A benchmark, not a
test; tests/benchmarks/test_bench_user_loops.py holds the aims on a cheap
configuration.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before torch loads its thread pools

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

LOOPS = ("char_lm", "seq2seq", "cnn")
FAULTS = ("data", "lr_blowup")
MODES = ("clean", "unguarded", "guarded")


@dataclass(frozen=True)
class LoopConfig:
    steps: int = 2000
    batch_size: int = 32
    fault_step: int = 1000
    bad_batches: int = 5
    lr_factor: float = 50.0
    lr_steps: int = 100
    # False: the pipeline decides beside training, as in a real run (the default Guard), and
    # actions come when it has decided; the run then reports how late each one was applied.
    lockstep: bool = True
    # The tail eval: the mean of the eval loss every tail_every steps over the last tail_share.
    tail_share: float = 0.1
    tail_every: int = 25
    # The LR falls (half a cosine) to decay_to of its base over the last decay_share of the run,
    # as a user's schedule would end: at a constant LR the last-step eval swings by tens of % from
    # one point to the next (issue 38), so a last-step gap says little. 0: constant to the end.
    decay_share: float = 0.0
    decay_to: float = 0.1


@dataclass
class Loop:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loader: DataLoader
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    eval_x: torch.Tensor
    eval_y: torch.Tensor
    # A copy made before any Guard hooks the model: tail evals run on it, so that the Guard's
    # forward hooks (the logits signal) never see an eval batch in the middle of training.
    probe: nn.Module

    def evaluate(self) -> float:
        self.model.eval()
        with torch.no_grad():
            value = float(self.loss(self.model, self.eval_x, self.eval_y))
        self.model.train()
        return value

    def evaluate_copy(self) -> float:
        """The eval loss of the model's current weights, computed on the hook-free copy."""
        self.probe.load_state_dict(self.model.state_dict())
        self.probe.eval()
        with torch.no_grad():
            return float(self.loss(self.probe, self.eval_x, self.eval_y))


def tail_steps(cfg: LoopConfig) -> set[int]:
    """The steps (updates done) after which the tail eval is taken."""
    first = cfg.steps - int(cfg.steps * cfg.tail_share)
    return {s for s in range(first + 1, cfg.steps + 1) if s % cfg.tail_every == 0}


def _schedule(cfg: LoopConfig, fault: str) -> Callable[[int], float]:
    """A short warm-up, constant, then the decay over the last ``decay_share``; x``lr_factor``
    over the blow-up's window."""
    decay_from = cfg.steps - int(cfg.steps * cfg.decay_share)

    def factor(step: int) -> float:
        base = min(1.0, (step + 1) / 50)
        if step >= decay_from and cfg.decay_share > 0:
            done = (step - decay_from) / max(1, cfg.steps - 1 - decay_from)
            base *= cfg.decay_to + (1 - cfg.decay_to) * 0.5 * (1 + math.cos(math.pi * done))
        if fault == "lr_blowup" and cfg.fault_step <= step < cfg.fault_step + cfg.lr_steps:
            return base * cfg.lr_factor
        return base

    return factor


def _text_ids() -> torch.Tensor:
    import argparse as a
    import collections as c
    import dataclasses as d

    text = "\n".join(Path(str(m.__file__)).read_text(encoding="utf-8") for m in (a, c, d))
    return torch.tensor([min(ord(ch), 127) for ch in text], dtype=torch.long)


class CharGRU(nn.Module):
    def __init__(self, vocab: int = 128, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 32)
        self.gru = nn.GRU(32, width, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(x))[0])


class Seq2Seq(nn.Module):
    """A GRU encoder-decoder; the decoder is fed the target shifted right (teacher forcing)."""

    def __init__(self, vocab: int = 11, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab + 1, 16)  # + the start token
        self.encoder = nn.GRU(16, width, batch_first=True)
        self.decoder = nn.GRU(16, width, batch_first=True)
        self.head = nn.Linear(width, vocab)
        self.start = vocab

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, h = self.encoder(self.embed(x))
        shifted = torch.cat([torch.full_like(y[:, :1], self.start), y[:, :-1]], dim=1)
        return self.head(self.decoder(self.embed(shifted), h)[0])


def _token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x, y) if isinstance(model, Seq2Seq) else model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _class_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def build(name: str, seed: int, cfg: LoopConfig, fault: str) -> Loop:
    """The loop ``name`` with its model, data and schedule, all fixed by ``seed``."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if name == "char_lm":
        ids = _text_ids()
        block = 32
        starts = torch.arange(0, len(ids) - block - 1, block // 2)
        windows = ids[starts[:, None] + torch.arange(block + 1)]
        held = int(len(windows) * 0.9)
        train = TensorDataset(windows[:held, :-1], windows[:held, 1:])
        eval_x, eval_y = windows[held:, :-1][:256], windows[held:, 1:][:256]
        model: nn.Module = CharGRU()
        lr, loss = 3e-3, _token_loss
    elif name == "seq2seq":
        digits = torch.randint(0, 10, (6000, 8), generator=gen)
        pairs_x, pairs_y = digits, digits.flip(1)
        train = TensorDataset(pairs_x[:5000], pairs_y[:5000])
        eval_x, eval_y = pairs_x[5000:5500], pairs_y[5000:5500]
        model, lr, loss = Seq2Seq(), 3e-3, _token_loss
    elif name == "cnn":
        from sklearn.datasets import load_digits

        digits_data = load_digits()
        images = torch.tensor(digits_data.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits_data.target, dtype=torch.long)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
        images, labels = images[order], labels[order]
        train = TensorDataset(images[:1500], labels[:1500])
        eval_x, eval_y = images[1500:], labels[1500:]
        model = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 16, 10),
        )
        lr, loss = 1e-3, _class_loss
    else:
        raise ValueError(f"unknown loop {name!r}; choose from {', '.join(LOOPS)}")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(cfg, fault))
    loader = DataLoader(
        train, batch_size=cfg.batch_size, shuffle=True, drop_last=True, generator=gen
    )
    return Loop(model, optimizer, scheduler, loader, loss, eval_x, eval_y, copy.deepcopy(model))


def corrupt(
    cfg: LoopConfig, fault: str, index: int | None, seed: int, y: torch.Tensor
) -> torch.Tensor:
    """The batch's targets as the faulty run sees them (shuffled across the batch if struck)."""
    if fault != "data" or index is None:
        return y
    if not cfg.fault_step <= index < cfg.fault_step + cfg.bad_batches:
        return y
    gen = torch.Generator().manual_seed(seed * 100_003 + index)
    flat = y.reshape(-1)
    return flat[torch.randperm(flat.numel(), generator=gen)].reshape(y.shape)


def run(
    name: str,
    fault: str,
    mode: str,
    seed: int,
    cfg: LoopConfig,
    leave_out: list[list[int]] | None = None,
    drop_updates: list[int] | None = None,
) -> dict[str, Any]:
    """One run; ``mode`` clean (no fault, no guard), unguarded or guarded (the fault either way).

    ``leave_out`` (unguarded): inclusive ranges of global batch indices not trained on, as a
    guarded run's skip windows: the unguarded loop then reads the batches that run kept.
    ``drop_updates``: global batch indices whose update is not made (the step and the schedule
    still advance), as the updates a guarded run skipped.
    """
    started = time.monotonic()
    struck = "clean" if mode == "clean" else fault
    loop = build(name, seed, cfg, struck)
    out: dict[str, Any] = {"loop": name, "fault": fault, "mode": mode, "seed": seed}
    tail = tail_steps(cfg)
    if mode != "guarded":
        step = index = 0
        evals = []
        while step < cfg.steps:
            for x, y in loop.loader:
                index += 1
                if any(a <= index - 1 <= b for a, b in leave_out or ()):
                    continue
                y = corrupt(cfg, struck, index - 1, seed, y)
                loop.optimizer.zero_grad(set_to_none=True)
                loop.loss(loop.model, x, y).backward()
                if index - 1 not in (drop_updates or ()):
                    loop.optimizer.step()
                loop.scheduler.step()
                step += 1
                if step in tail:
                    evals.append(loop.evaluate_copy())
                if step >= cfg.steps:
                    break
        out.update(
            eval=loop.evaluate(),
            tail_eval=sum(evals) / len(evals) if evals else math.nan,
            skipped_batches=0,
            rerun_steps=0,
        )
    else:
        out.update(_guarded(loop, struck, seed, cfg))
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def _guarded(loop: Loop, fault: str, seed: int, cfg: LoopConfig) -> dict[str, Any]:
    from spikeguard import Guard, GuardConfig

    workdir = tempfile.mkdtemp(prefix="spikeguard-user-loop-")
    guard = Guard(
        loop.model,
        loop.optimizer,
        loop.scheduler,
        run_id=f"user-loop-{fault}-{seed}-{time.monotonic_ns() % 10**9}",
        # No data_seed: the Guard then draws the loader's order exactly as the unguarded loop
        # does (its generator), so a guarded run differs from the unguarded one only by what the
        # Guard did. (With data_seed the order was the Guard's own from step 0: the two runs were
        # different trajectories, and their gap was noise as large as the fault's effect.)
        config=GuardConfig(checkpoint_dir=workdir, lockstep=cfg.lockstep, resume=False),
    )
    tail = tail_steps(cfg)
    evals: dict[int, float] = {}  # by step: a re-run after a rollback replaces what it re-ran
    updates: dict[int, tuple[int | None, bool]] = {}  # by step: its batch, and was it applied
    try:
        data = guard.data(loop.loader, max_steps=cfg.steps)
        for x, y in data:
            y = corrupt(cfg, fault, data.last_index, seed, y)
            loop.optimizer.zero_grad(set_to_none=True)
            loss = loop.loss(loop.model, x, y)
            loss.backward()
            step = guard.step_count
            updates[step] = (data.last_index, guard.step(loss))
            if guard.step_count in tail:
                evals[guard.step_count] = loop.evaluate_copy()
        summary = guard.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    counters = guard.counters
    return {
        "eval": loop.evaluate(),
        "tail_eval": sum(evals.values()) / len(evals) if evals else math.nan,
        "skipped_batches": int(counters["skipped_batches"]),
        "skip_ranges": [list(r) for r in getattr(guard.loader, "skip_ranges", [])],
        # the batches of kept steps whose update the Guard skipped (a re-run's replace the first)
        "skipped_updates": sorted(
            index for index, applied in updates.values() if not applied and index is not None
        ),
        "rerun_steps": int(counters["steps"]) - cfg.steps,
        "actions": sorted(a["kind"] for a in guard.applied if a["status"] == "applied"),
        # the LR the next update would use over the schedule's (the optimizer's param_groups
        # hold the schedule's own value: the Guard's factor is applied around each update only)
        "lr_factor_at_end": guard.lr.effective() / loop.optimizer.param_groups[0]["lr"],
        "summary": str(summary),
        # steps between when each state-changing action was due and when it was applied
        "late_steps": [
            a["step"] - int(m.group(1))
            for a in guard.applied
            if a["kind"] not in ("alert", "checkpoint", "pulse")
            and (m := re.match(r"late \(due at step (\d+)\)", a["result"]))
        ],
    }


def fault_runs(
    name: str, fault: str, seed: int, cfg: LoopConfig, same_data: bool = True
) -> list[dict[str, Any]]:
    """The unguarded and the guarded run of one loop, fault and seed; the guarded one carries
    ``same_data_eval`` / ``same_data_tail_eval``: the unguarded loop reading exactly the batches
    it kept (the unguarded run itself when it left nothing out)."""
    unguarded = run(name, fault, "unguarded", seed, cfg)
    guarded = run(name, fault, "guarded", seed, cfg)
    same = unguarded
    left_out = guarded["skip_ranges"] or guarded["skipped_updates"]
    # (after an LR blow-up the guarded run's LR differs too: reading the same data says nothing)
    if same_data and fault == "data" and left_out:
        same = run(
            name,
            fault,
            "unguarded",
            seed,
            cfg,
            guarded["skip_ranges"],
            guarded["skipped_updates"],
        )
    if same is not unguarded or not left_out:
        guarded["same_data_eval"] = same["eval"]
        guarded["same_data_tail_eval"] = same["tail_eval"]
    return [unguarded, guarded]


def _task(args: tuple[str, str, int, LoopConfig, bool, bool]) -> list[dict[str, Any]]:
    name, fault, seed, cfg, same_data, verbose = args
    if not verbose:
        logging.getLogger("spikeguard").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    if fault == "none":
        clean = run(name, "none", "clean", seed, cfg)
        return [clean]
    return fault_runs(name, fault, seed, cfg, same_data)


def sign_p(worse: int, better: int) -> float:
    """Two-sided sign test: the chance of a split at least this uneven if either is as likely."""
    n = worse + better
    if n == 0:
        return 1.0
    k = min(worse, better)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired(runs: list[dict[str, Any]], name: str, fault: str, key: str) -> dict[str, Any]:
    """Per seed: clean, unguarded, guarded and same-data by ``key`` (``eval`` or ``tail_eval``),
    and over seeds the median and range of guarded / clean, guarded / unguarded and same data /
    clean (the loop's own noise at leaving the guarded run's batches out), and the signs."""
    clean = {r["seed"]: r[key] for r in runs if r["loop"] == name and r["mode"] == "clean"}
    mine = [r for r in runs if r["loop"] == name and r["fault"] == fault]
    unguarded = {r["seed"]: r[key] for r in mine if r["mode"] == "unguarded"}
    guarded = {r["seed"]: r for r in mine if r["mode"] == "guarded"}
    seeds = sorted(set(clean) & set(unguarded) & set(guarded))
    same = f"same_data_{key}"

    def spread(values: list[float]) -> tuple[float, float, float]:
        return statistics.median(values), min(values), max(values)

    g = {s: guarded[s][key] for s in seeds}
    return {
        "loop": name,
        "fault": fault,
        "measure": key,
        "seeds": seeds,
        "clean": [clean[s] for s in seeds],
        "unguarded": [unguarded[s] for s in seeds],
        "guarded": [g[s] for s in seeds],
        "guarded_vs_clean": spread([g[s] / clean[s] for s in seeds]),
        "guarded_vs_unguarded": spread([g[s] / unguarded[s] for s in seeds]),
        "same_data_vs_clean": spread(
            [guarded[s][same] / clean[s] for s in seeds if same in guarded[s] and fault == "data"]
            or [math.nan]
        ),
        # guarded against unguarded, seed by seed: better, equal, worse
        "signs": (
            sum(g[s] < unguarded[s] for s in seeds),
            sum(g[s] == unguarded[s] for s in seeds),
            sum(g[s] > unguarded[s] for s in seeds),
        ),
        "skipped_share_max": max(guarded[s]["skipped_batches"] for s in seeds)
        / guarded[seeds[0]]["steps"],
        "rerun_max": max(guarded[s]["rerun_steps"] for s in seeds),
    }


def _ratio(spread: tuple[float, float, float]) -> str:
    mid, lo, hi = spread
    return f"{mid - 1:+6.1%} [{lo - 1:+6.1%},{hi - 1:+6.1%}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", default=",".join(LOOPS))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--steps", type=int, default=LoopConfig.steps)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument(
        "--decay-share",
        type=float,
        default=0.1,
        help="the LR decays to 0.1x over this last share of the run (0: constant, as the "
        "earlier figures and the quick tests)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one process each)")
    parser.add_argument(
        "--no-same-data", action="store_true", help="skip the same-data runs (faster)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print every run and row as one JSON line, last"
    )
    parser.add_argument("--runs", help="append each run to this file as a JSON line when done")
    parser.add_argument(
        "--from-runs", help="run nothing: the tables of the runs in this file (from --runs)"
    )
    parser.add_argument("--verbose", action="store_true", help="show the Guard's WARNING lines")
    parser.add_argument(
        "--no-lockstep",
        action="store_true",
        help="let the pipeline decide beside training (as a real run): results vary with the "
        "machine's load, and each row says how late its actions were applied",
    )
    args = parser.parse_args(argv)
    cfg = LoopConfig(
        steps=args.steps,
        fault_step=args.steps // 2,
        lockstep=not args.no_lockstep,
        decay_share=args.decay_share,
    )
    loops, faults = args.loops.split(","), args.faults.split(",")
    seeds = range(args.seed, args.seed + args.seeds)
    same_data = not args.no_same_data
    # seed by seed, so that the seeds done when a long run is cut short are whole
    tasks = [
        (n, f, s, cfg, same_data, args.verbose)
        for s in seeds
        for n in loops
        for f in (*faults, "none")
    ]
    runs: list[dict[str, Any]] = []
    if args.from_runs:
        runs = [json.loads(line) for line in Path(args.from_runs).read_text().splitlines()]
        seeds = range(min(r["seed"] for r in runs), max(r["seed"] for r in runs) + 1)
        tasks = []

    def report(done: list[dict[str, Any]]) -> None:
        for r in done:
            r.setdefault("steps", cfg.steps)
            runs.append(r)
            if args.runs:
                with open(args.runs, "a", encoding="utf-8") as sink:
                    sink.write(json.dumps(r) + "\n")
            print(
                f"{r['loop']:8s} {r['fault']:10s} seed {r['seed']} {r['mode']:10s} "
                f"eval {r['eval']:.4f} tail {r['tail_eval']:.4f} "
                + (
                    f"same data {r.get('same_data_eval', math.nan):.4f} "
                    f"skipped {r['skipped_batches']:4d} re-run {r['rerun_steps']:4d} "
                    f"late {r.get('late_steps', [])} {','.join(r['actions'])} "
                    if r["mode"] == "guarded"
                    else ""
                )
                + f"({r['seconds']} s)",
                file=sys.stderr,
                flush=True,
            )

    if args.jobs > 1 and tasks:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
            for done in pool.map(_task, tasks):
                report(done)
    else:
        for task in tasks:
            report(_task(task))
    rows = [paired(runs, n, f, key) for key in ("eval", "tail_eval") for n in loops for f in faults]
    for key, title in (("eval", "final eval"), ("tail_eval", "tail eval")):
        print(
            f"{title}, {len(seeds)} seeds {seeds.start}-{seeds.stop - 1}, {cfg.steps} steps, LR "
            f"decay over the last {cfg.decay_share:.0%}: medians; ratios median [min, max]; "
            "signs: guarded better / equal / worse than unguarded (two-sided sign-test p)"
        )
        print(
            f"{'loop':8s} {'fault':10s} {'clean':>7s} {'unguard':>7s} {'guarded':>7s} "
            f"{'guarded/clean':>24s} {'guarded/unguarded':>24s} {'same data/clean':>24s} "
            f"{'signs':>8s} {'p':>5s} {'skipped':>7s} {'re-run':>6s}"
        )
        for row in rows:
            if row["measure"] != key:
                continue
            better, equal, worse = row["signs"]
            print(
                f"{row['loop']:8s} {row['fault']:10s} {statistics.median(row['clean']):7.4f} "
                f"{statistics.median(row['unguarded']):7.4f} "
                f"{statistics.median(row['guarded']):7.4f} {_ratio(row['guarded_vs_clean']):>24s} "
                f"{_ratio(row['guarded_vs_unguarded']):>24s} "
                f"{_ratio(row['same_data_vs_clean']):>24s} {better:2d}/{equal}/{worse:<2d}  "
                f"{sign_p(worse, better):5.2f} {row['skipped_share_max']:7.1%} "
                f"{row['rerun_max']:6d}"
            )
    if args.json:
        print(json.dumps({"runs": runs, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
