"""The instability lab: real instabilities of a small transformer, their early warning, and prevention.

    python benchmarks/bench_instability.py [--seeds N] [--seed FIRST] [--jobs J]
                                           [--out DIR] [--json] [--no-recovery]

Per mechanism of spikeguard/lab/instability/mechanisms.py, over N seeds
(default 5, from seed 1: the thresholds were chosen on seed 0):

1. the unstable recipe, its healthy twin (the published fix on) and the
   healthy recipe (a safe LR); the loss alarm of each unstable run by the
   written rule of labels.py (behind its twin, for good);
2. per signal, its lead on the loss alarm (median and range over the seeds)
   and how many of the healthy runs (twins and the healthy recipe) it warned on;
3. the unstable recipe again with the matching response (QK-clip, an LR cut,
   z-loss on): final eval loss with and without, mean and 95 % interval;
4. the recovery benchmark's ``instability`` fault (benchmarks/recovery_setup.py:
   the QUICK run at LR x25, nothing injected), trained by the same loop as its
   baselines with the responses on: final eval loss against its clean and
   unguarded runs (the other strategies' figures are bench_recovery.py's);
5. the signals' cost: seconds per step with and without them, one seed.

``--out DIR`` writes every lab run as a run file (DIR/NAME.csv, labels by the
rule) and its signals (DIR/NAME.signals.jsonl). ``--json``: the last line
printed is every figure as one JSON object. ``--cache`` keeps finished runs (resume, or
split the seeds between two runners and concatenate the files); ``--report-only`` reports
on a cache. 5 seeds took about 35 minutes on 2 heavily loaded cores with two runners.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before torch loads its thread pools

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import typing  # noqa: E402
from concurrent.futures import ProcessPoolExecutor, as_completed  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the recovery_* helpers next to this file

import torch  # noqa: E402

from spikeguard.lab.instability import labels, warning  # noqa: E402
from spikeguard.lab.instability.mechanisms import BY_NAME, HEALTHY, MECHANISMS  # noqa: E402
from spikeguard.lab.instability.responses import (  # noqa: E402
    LRCut,
    QKClip,
    ZLossOn,
    fused_qk_heads,
    lab_qk_heads,
)
from spikeguard.lab.instability.train import LabRun, train  # noqa: E402
from spikeguard.producers.signals import MechanismSignals, layer_groups  # noqa: E402

# The response matched to each mechanism (LR cut: the one for "an LR the model cannot hold").
PREVENTIONS = {
    "attention_logit_growth": ("qk_clip", "lr_cut"),
    "output_logit_divergence": ("lr_cut",),  # z never drifted on seed 0: z_loss_on never acted
    "short_warmup": ("lr_cut",),
    "stale_second_moment": (),  # not reproduced on seed 0 (no alarm, unstable ahead of twin)
}
HEALTHY_RESPONSES = "qk_clip+lr_cut+z_loss_on"  # every response at once, on the healthy recipe
QK_CLIP_THRESHOLD = 30.0  # under the warning threshold (50), over the healthy recipe's peak (~25)
# seed 0 also ran qk_clip alone (2.558) and lr_cut alone (2.536): the pair did better than either (2.471)
RECOVERY_VARIANTS = ("clean", "none", "qk_clip+lr_cut")
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def lab_responses(kind: str, model) -> list:
    out: list = []
    if "qk_clip" in kind:
        out.append(QKClip(lab_qk_heads(model), QK_CLIP_THRESHOLD))
    if "lr_cut" in kind:
        out.append(LRCut())
    if "z_loss_on" in kind:
        out.append(ZLossOn())
    return out


def summary(run: LabRun) -> dict:
    return {
        "loss": run.losses,
        "grad_norm": [r.grad_norm for r in run.steps],
        "lr": [r.lr for r in run.steps],
        "final": run.final_eval_loss,
        "seconds": run.seconds,
        "responses": run.responses,
        "warnings": {s.name: warning.first_warning(run, s) for s in warning.SIGNALS},
        "detector_flags": warning.detector_flags(run) if not run.responses else [],
    }


def lab_task(task: tuple[str, str, int], out: str | None) -> dict:
    torch.set_num_threads(1)
    name, variant, seed = task
    if name == "healthy":
        recipe = HEALTHY
    else:
        mechanism = BY_NAME[name]
        recipe = mechanism.twin if variant == "twin" else mechanism.unstable
    run = train(recipe, seed, responses=lambda model: lab_responses(variant, model))
    result = summary(run)
    result.update(name=name, variant=variant, seed=seed)
    if out is not None and variant in ("unstable", "twin"):
        Path(out).mkdir(parents=True, exist_ok=True)
        labels.write_signals(Path(out) / f"{name}-{variant}-s{seed}", run)
    return result


def recovery_task(variant: str, seed: int) -> dict:
    """The recovery benchmark's ``instability`` fault (QUICK), with the lab's responses."""
    torch.set_num_threads(1)
    from recovery_ledger import grad_norm
    from recovery_setup import QUICK, Block, build, evaluate, lm_loss

    from spikeguard.producers.data import GuardedLoader

    cfg = QUICK
    p = build(seed, cfg, "clean" if variant == "clean" else "instability")
    blocks = typing.cast("list[Block]", list(p.model.blocks))  # TinyGPT's Sequential of Blocks
    probe = MechanismSignals(
        {str(i): b.qkv for i, b in enumerate(blocks)},
        p.model.head,
        layer_groups(p.model, [f"blocks.{i}" for i in range(len(blocks))]),
        qkv_heads=cfg.heads,
    )

    class Knobs:
        lr_scale = 1.0
        z_loss = 0.0

    knobs = Knobs()
    responses: list = []
    if "qk_clip" in variant:
        responses.append(QKClip(fused_qk_heads(blocks), QK_CLIP_THRESHOLD))
    if "lr_cut" in variant:
        responses.append(LRCut())
    loader = GuardedLoader(p.loader, seed=seed)  # the order every strategy of bench_recovery sees
    step, said = 0, []
    while step < cfg.steps:
        for x, y in loader:
            for group in p.optimizer.param_groups:
                group["lr"] *= knobs.lr_scale  # the scheduler set the schedule's LR
            p.optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(p.model, x, y)
            loss.backward()
            norm = grad_norm(p.model)
            probe.before_update()
            p.optimizer.step()
            probe.after_update()
            torch.stack([loss.detach(), norm]).tolist()
            signals = probe.collect()
            for response in responses:
                line = response.after_step(step, signals, knobs)
                if line:
                    said.append(f"step {step}: {line}")
            p.scheduler.step()
            step += 1
            if step >= cfg.steps:
                break
    probe.close()
    return {
        "name": "recovery",
        "variant": variant,
        "seed": seed,
        "final": evaluate(p),
        "responses": said,
    }


def overhead(steps: int = 100, repeats: int = 2) -> dict:
    """Seconds per step of the healthy recipe with and without the signals (best of ``repeats``)."""
    torch.set_num_threads(1)
    recipe = HEALTHY.with_(steps=steps)
    on, off = [], []
    for _ in range(repeats):
        off.append(train(recipe, 0, signals=False).seconds / steps)
        on.append(train(recipe, 0, signals=True).seconds / steps)
    return {"off_s_per_step": min(off), "on_s_per_step": min(on), "ratio": min(on) / min(off)}


def guard_overhead(steps: int = 100, repeats: int = 3) -> dict:
    """Seconds per step of a Guard (no pipeline: its steps go to a bare bus) training the recovery
    benchmark's model, with and without the mechanism signals (producers/signals/prevention.py),
    interleaved, best of ``repeats``."""
    import tempfile

    from recovery_guarded import _opt_in
    from recovery_setup import QUICK, build, lm_loss

    from spikeguard.bus import EmbeddedBus
    from spikeguard.producers import Guard, GuardConfig

    torch.set_num_threads(1)
    best: dict[bool, float] = {}
    for _ in range(repeats):
        for signals in (False, True):
            p, bus = build(0, QUICK, "clean"), EmbeddedBus()
            with tempfile.TemporaryDirectory() as workdir:
                config = GuardConfig(checkpoint_dir=workdir, checkpoint_every=1000, resume=False)
                guard = Guard(
                    p.model, p.optimizer, p.scheduler, run_id="cost", bus=bus, config=config
                )
                prevention = _opt_in(guard, p.model, QUICK) if signals else None
                batches = iter(guard.data(p.loader, max_steps=steps + 10))
                for _ in range(10):  # warm-up: first-step allocations
                    x, y = next(batches)
                    p.optimizer.zero_grad(set_to_none=True)
                    guard.step(lm_loss(p.model, x, y))
                started = time.perf_counter()
                for x, y in batches:
                    p.optimizer.zero_grad(set_to_none=True)
                    guard.step(lm_loss(p.model, x, y))
                seconds = (time.perf_counter() - started) / steps
                guard.close()
                if prevention is not None:
                    prevention.signals.close()
            bus.close()
            best[signals] = min(best.get(signals, math.inf), seconds)
    return {
        "off_s_per_step": best[False],
        "on_s_per_step": best[True],
        "ratio": best[True] / best[False],
    }


def mean_ci(values: list[float]) -> tuple[float, float]:
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mean = sum(values) / n
    if n < 2 or not all(math.isfinite(v) for v in values):
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, T95.get(n - 1, 2.0) * sd / math.sqrt(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1, help="first seed (thresholds: seed 0)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the lab runs as run files here")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-recovery", action="store_true", help="skip the recovery fault")
    parser.add_argument(
        "--guard-overhead",
        action="store_true",
        help="only the signals' cost per step of a Guard on the recovery benchmark's model",
    )
    parser.add_argument(
        "--detector-only",
        action="store_true",
        help="only the runs the pipeline's mechanism rules are scored on: the healthy recipe and "
        "each mechanism's unstable run and twin (no responses, no recovery fault)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        help="JSONL of finished runs: appended as runs finish, runs found there are not run again",
    )
    parser.add_argument(
        "--report-only", action="store_true", help="report on the --cache file's complete seeds"
    )
    args = parser.parse_args(argv)
    seeds = list(range(args.seed, args.seed + args.seeds))
    tasks: list[tuple[str, str, int]] = []
    for s in seeds:  # seed by seed, so an interrupted run leaves whole seeds behind
        if args.detector_only:
            tasks += [("healthy", "healthy", s)]
            tasks += [(m.name, v, s) for m in MECHANISMS for v in ("unstable", "twin")]
            continue
        tasks += [("healthy", v, s) for v in ("healthy", HEALTHY_RESPONSES)]
        for m in MECHANISMS:
            tasks += [(m.name, v, s) for v in ("unstable", "twin", *PREVENTIONS[m.name])]
        if not args.no_recovery:
            tasks += [("recovery", v, s) for v in RECOVERY_VARIANTS]
    if args.guard_overhead:
        cost = guard_overhead()
        print(
            f"Guard step {cost['off_s_per_step']:.4f} s without the signals, "
            f"{cost['on_s_per_step']:.4f} s with them: x{cost['ratio']:.3f}"
        )
        return 0
    done = _read_cache(args.cache)
    out = str(args.out) if args.out else None
    started = time.time()
    if args.detector_only:
        todo = [t for t in tasks if t not in done]
        with ProcessPoolExecutor(args.jobs) as pool:
            for result in pool.map(lab_task, todo, [out] * len(todo)):
                done[(result["name"], result["variant"], result["seed"])] = result
                if args.cache is not None:
                    with args.cache.open("a", encoding="utf-8") as cache:
                        cache.write(json.dumps(result) + "\n")
        flags = detector_report([done[t] for t in tasks], seeds)
        print(render_detector(flags))
        if args.json:
            print(json.dumps(flags, default=_json_default))
        return 0
    if not args.report_only:
        todo = [t for t in tasks if t not in done]
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = [
                pool.submit(recovery_task, v, s)
                if name == "recovery"
                else pool.submit(lab_task, (name, v, s), out)
                for name, v, s in todo
            ]
            for future in as_completed(futures):
                result = future.result()
                done[(result["name"], result["variant"], result["seed"])] = result
                if args.cache is not None:
                    with args.cache.open("a", encoding="utf-8") as cache:
                        cache.write(json.dumps(result) + "\n")
        done[("overhead", "", 0)] = {"name": "overhead", **overhead()}
        if args.cache is not None:
            with args.cache.open("a", encoding="utf-8") as cache:
                cache.write(json.dumps(done[("overhead", "", 0)]) + "\n")
    lab = [r for k, r in done.items() if k[0] not in ("recovery", "overhead")]
    recovery = [r for k, r in done.items() if k[0] == "recovery"]
    cost = done.get(("overhead", "", 0), {"ratio": math.nan})
    complete = [s for s in seeds if all(t in done for t in tasks if t[2] == s)]
    report = analyse(lab, recovery, complete, cost, args.out)
    report["seconds"] = round(time.time() - started, 1)
    print(render(report))
    if args.json:
        print(json.dumps(report, default=_json_default))
    return 0


def _read_cache(path: Path | None) -> dict:
    done: dict = {}
    if path is not None and path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            done[(r["name"], r.get("variant", ""), r.get("seed", 0))] = r
    return done


def _json_default(value):
    return str(value)


def analyse(lab: list[dict], recovery: list[dict], seeds: list[int], cost: dict, out) -> dict:
    by = {(r["name"], r["variant"], r["seed"]): r for r in lab}
    report: dict = {"seeds": seeds, "overhead": cost, "mechanisms": [], "recovery": {}}
    healthy_runs = [by[("healthy", "healthy", s)] for s in seeds]
    for m in MECHANISMS:
        twins = [by[(m.name, "twin", s)] for s in seeds]
        row: dict = {
            "name": m.name,
            "source": m.source,
            "twin": m.twin_is,
            "alarms": [],
            "leads": {},
        }
        for s in seeds:
            unstable, twin = by[(m.name, "unstable", s)], by[(m.name, "twin", s)]
            flags = labels.unstable_steps(unstable["loss"], twin["loss"])
            alarm = labels.loss_alarm(flags)
            row["alarms"].append(alarm)
            for signal in warning.SIGNALS:
                row["leads"].setdefault(signal.name, []).append(
                    warning.lead(alarm, unstable["warnings"][signal.name])
                )
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                for variant, r, f in (
                    ("unstable", unstable, flags),
                    ("twin", twin, [False] * len(flags)),
                ):
                    run_id = f"{m.name}-{variant}-s{s}"
                    labels.write_steps(
                        out / run_id,
                        run_id,
                        r["loss"],
                        r["grad_norm"],
                        r["lr"],
                        labels.step_labels(f, m.name),
                    )
        row["warns_on_twin"] = {
            sig.name: sum(1 for r in twins if r["warnings"][sig.name] is not None)
            for sig in warning.SIGNALS
        }
        row["warns_on_healthy"] = {
            sig.name: sum(1 for r in healthy_runs if r["warnings"][sig.name] is not None)
            for sig in warning.SIGNALS
        }
        if out is not None:  # the responses' own thresholds, read off the twins' recorded signals
            row["twin_would_act"] = {
                "qk_clip": sum(
                    _peak(out / f"{m.name}-twin-s{s}", "attention_max") > QK_CLIP_THRESHOLD
                    for s in seeds
                ),
                "lr_cut": sum(
                    _peak(out / f"{m.name}-twin-s{s}", "update_ratio") > LRCut().threshold
                    for s in seeds
                ),
            }
        finals = {"unstable": [by[(m.name, "unstable", s)]["final"] for s in seeds]}
        finals["twin"] = [by[(m.name, "twin", s)]["final"] for s in seeds]
        for p in PREVENTIONS[m.name]:
            finals[p] = [by[(m.name, p, s)]["final"] for s in seeds]
        row["final"] = {k: {"mean_ci": mean_ci(v), "per_seed": v} for k, v in finals.items()}
        row["actions"] = {
            p: sum(len(by[(m.name, p, s)]["responses"]) for s in seeds) / max(1, len(seeds))
            for p in PREVENTIONS[m.name]
        }
        report["mechanisms"].append(row)
    report["detector"] = detector_report(lab, seeds)
    report["healthy_final"] = mean_ci([r["final"] for r in healthy_runs])
    guarded = [by[("healthy", HEALTHY_RESPONSES, s)] for s in seeds]
    report["healthy_responses"] = {
        "final": mean_ci([r["final"] for r in guarded]),
        "actions": [len(r["responses"]) for r in guarded],
        "lines": [line for r in guarded for line in r["responses"]][:10],
    }
    for v in RECOVERY_VARIANTS:
        losses = [r["final"] for r in recovery if r["variant"] == v]
        if losses:
            report["recovery"][v] = {
                "mean_ci": mean_ci(losses),
                "per_seed": losses,
                "actions": sum(len(r["responses"]) for r in recovery if r["variant"] == v)
                / len(losses),
            }
    return report


def detector_report(lab: list[dict], seeds: list[int]) -> dict:
    """Per recipe, the first step the pipeline's mechanism rules flag on each seed (None: never),
    and on the unstable runs, its lead over the loss alarm."""
    by = {(r["name"], r["variant"], r["seed"]): r for r in lab}

    def first(name: str, variant: str, s: int) -> int | None:
        flagged = by[(name, variant, s)].get("detector_flags", [])
        return flagged[0] if flagged else None

    report: dict = {"healthy": [first("healthy", "healthy", s) for s in seeds]}
    for m in MECHANISMS:
        alarms = [
            labels.loss_alarm(
                labels.unstable_steps(
                    by[(m.name, "unstable", s)]["loss"], by[(m.name, "twin", s)]["loss"]
                )
            )
            for s in seeds
        ]
        unstable = [first(m.name, "unstable", s) for s in seeds]
        report[m.name] = {
            "unstable": unstable,
            "twin": [first(m.name, "twin", s) for s in seeds],
            "flagged_steps_twin": [
                len(by[(m.name, "twin", s)].get("detector_flags", [])) for s in seeds
            ],
            "alarms": alarms,
            "leads": [warning.lead(a, w) for a, w in zip(alarms, unstable)],
        }
    return report


def render_detector(report: dict) -> str:
    def runs(firsts: list) -> str:
        hit = [f for f in firsts if f is not None]
        return f"{len(hit)}/{len(firsts)}" + (f" (steps {min(hit)}-{max(hit)})" if hit else "")

    lines = ["the pipeline's mechanism rules (attention-logit growth, defaults): runs flagged"]
    lines.append(f"  healthy recipe: {runs(report['healthy'])}")
    for name, row in report.items():
        if name == "healthy":
            continue
        lines.append(
            f"  {name}: unstable {runs(row['unstable'])}, lead over the loss alarm "
            f"{_fmt_lead(row['leads'])}; twin {runs(row['twin'])} "
            f"(flagged steps per twin {row['flagged_steps_twin']})"
        )
    return "\n".join(lines)


def _peak(path: Path, signal: str) -> float:
    """The largest value of ``signal`` over a run's recorded signals (NaN if not recorded)."""
    file = path.with_suffix(".signals.jsonl")
    if not file.exists():
        return math.nan
    peak = -math.inf
    for line in file.read_text(encoding="utf-8").splitlines():
        value = json.loads(line)[signal]
        values = [v for vs in value.values() for v in (vs if isinstance(vs, list) else [vs])]
        peak = max([peak, *values])
    return peak


def _fmt_lead(values: list[int | None]) -> str:
    got = [v for v in values if v is not None]
    if not got:
        return "none"
    return f"{warning.median(got):+.0f} [{min(got):+d}, {max(got):+d}] ({len(got)}/{len(values)})"


def render(report: dict) -> str:
    lines = [f"seeds {report['seeds']}; signals cost x{report['overhead']['ratio']:.3f} per step"]
    hm, hc = report["healthy_final"]
    lines.append(f"healthy recipe final eval loss {hm:.3f} +- {hc:.3f}")
    hr = report["healthy_responses"]
    lines.append(
        f"healthy recipe with every response on: {hr['final'][0]:.3f} +- {hr['final'][1]:.3f}, "
        f"actions per seed {hr['actions']} {hr['lines'][:3]}"
    )
    for row in report["mechanisms"]:
        lines.append(f"\n{row['name']}  ({row['source']}); twin: {row['twin']}")
        lines.append(f"  loss alarm steps: {row['alarms']}")
        n = len(row["alarms"])
        for name, leads in row["leads"].items():
            lines.append(
                f"  {name:14s} lead median [min, max] (n): {_fmt_lead(leads):28s}"
                f" warns on twin {row['warns_on_twin'][name]}/{n},"
                f" on healthy recipe {row['warns_on_healthy'][name]}/{n}"
            )
        if "twin_would_act" in row:
            acts = row["twin_would_act"]
            lines.append(
                f"  on the twins QK-clip would act in {acts['qk_clip']}/{n}, LR cut in {acts['lr_cut']}/{n}"
            )
        for k, v in row["final"].items():
            m, c = v["mean_ci"]
            acts = row["actions"].get(k)
            extra = f"  ({acts:.1f} actions/run)" if acts is not None else ""
            lines.append(f"  final eval {k:10s} {m:.3f} +- {c:.3f}{extra}")
    if "detector" in report:
        lines.append("\n" + render_detector(report["detector"]))
    if report["recovery"]:
        lines.append("\nrecovery benchmark `instability` fault (QUICK, LR x25):")
        for k, v in report["recovery"].items():
            m, c = v["mean_ci"]
            lines.append(f"  {k:16s} {m:.3f} +- {c:.3f}  ({v['actions']:.1f} actions/run)")
    lines.append(f"\n{report.get('seconds', 0)} s")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
