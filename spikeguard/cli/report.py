"""``spikeguard report``: what happened to each run, from the recorded topics.

Incidents (onset, type, worst urgency, length), the actions taken and how the
trainers answered them, checkpoints, and dead letters: the audit trail.

Sources: ``--data-dir`` (a directory the embedded bus recorded), ``--jsonl``
(an export made with ``--export``), else the bus (Kafka: the topics from their
first offset). ``--out DIR`` writes, per run, ``RUN.png`` (loss and gradient
norm with anomalies, incidents, actions and rollbacks marked; needs the
``[report]`` extra) and ``RUN.html`` (the plot, the incidents with wall-clock
times and evidence, the actions and the trainer's acks, with epochs).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

from pathlib import Path
from typing import TYPE_CHECKING

from spikeguard.cli._common import add_settings_flags, settings_from
from spikeguard.errors import SpikeguardError
from spikeguard.schemas import DeadLetter, Topics, Urgency

if TYPE_CHECKING:
    from spikeguard.bus import Bus

_URGENCY = {u: i for i, u in enumerate(Urgency)}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="incidents, actions and acks per run", description=__doc__
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data-dir", help="a directory recorded by the embedded bus (else Kafka)")
    source.add_argument("--jsonl", metavar="FILE", help="a JSONL export (see --export)")
    parser.add_argument("--run-id", action="append", help="only these runs (repeatable)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    parser.add_argument("--out", metavar="DIR", help="write RUN.png and RUN.html per run here")
    parser.add_argument("--export", metavar="FILE", help="write the runs' events as a JSONL export")
    parser.add_argument(
        "--incidents",
        metavar="DIR",
        help="the Guard's incident records (and spikeguard inspect's output) to show "
        "per incident in the HTML",
    )
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def summarise(decisions, actions, acks, checkpoints, letters) -> dict:
    runs: dict[str, dict] = defaultdict(lambda: {"incidents": {}, "actions": [], "checkpoints": 0})
    for d in decisions:
        if not d.incident_id:
            continue
        incident = runs[d.run_id]["incidents"].setdefault(
            d.incident_id,
            {
                "onset_step": d.incident_onset_step
                if d.incident_onset_step is not None
                else d.step,
                "epoch": d.epoch,
                "type": d.type.value,
                "urgency": d.urgency.value,
                "steps": 0,
            },
        )
        incident["steps"] += 1
        if _URGENCY[d.urgency] > _URGENCY[Urgency(incident["urgency"])]:
            incident["urgency"] = d.urgency.value
    answers = {a.action_id: a.status.value for a in acks}
    for a in actions:
        runs[a.run_id]["actions"].append(
            {
                "kind": a.kind.value,
                "apply_at_step": a.apply_at_step,
                "status": answers.get(a.action_id, "no ack"),
                "reason": a.reason,
            }
        )
    for c in checkpoints:
        runs[c.run_id]["checkpoints"] += 1
    return {
        "runs": {
            run: {**info, "incidents": list(info["incidents"].values())}
            for run, info in sorted(runs.items())
        },
        "dead_letters": dict(Counter(letter.source_topic for letter in letters)),
    }


def _load(args: argparse.Namespace, topics: Topics, runs: set[str] | None):
    """The recorded runs and the dead letters (none in a JSONL export)."""
    from spikeguard.reporting import load_bus, load_directory, load_jsonl

    if args.jsonl:
        return load_jsonl(args.jsonl, runs), []
    bus: Bus
    if args.data_dir:
        from spikeguard.bus import EmbeddedBus

        recorded = load_directory(args.data_dir, topics.prefix, runs)
        bus = EmbeddedBus(partitions=64, data_dir=args.data_dir)
        source = str(args.data_dir)
    else:
        from spikeguard.runtime import make_bus

        bus = make_bus(args.settings)
        source = args.settings.bootstrap_servers or "the embedded bus"
        recorded = None
    try:
        if recorded is None:
            recorded = load_bus(bus, topics, runs, source=source)
        letters = []
        for record in bus.read_all(topics.dlq, timeout=30):
            try:
                letters.append(record.decoded(DeadLetter))
            except SpikeguardError:
                continue
        return recorded, letters
    finally:
        bus.close()


def _write_files(recorded: dict, out: str, incidents: str | None = None) -> list[str]:
    from spikeguard.reporting import build_timeline
    from spikeguard.reporting.figure import draw
    from spikeguard.reporting.page import write

    directory = Path(out)
    if not directory.parent.is_dir():
        raise SpikeguardError(f"--out {out}: {directory.parent} does not exist")
    directory.mkdir(exist_ok=True)
    written = []
    for run_id, record in recorded.items():
        timeline = build_timeline(record, incidents)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)
        png, page = directory / f"{safe}.png", directory / f"{safe}.html"
        draw(timeline, str(png))
        write(timeline, str(page), str(png))
        written += [str(png), str(page)]
    return written


def run(args: argparse.Namespace) -> int:
    args.settings = settings = settings_from(args)
    topics = Topics(settings.topic_prefix)
    runs = set(args.run_id) if args.run_id else None
    recorded, letters = _load(args, topics, runs)
    report = summarise(
        [d for r in recorded.values() for d in r.decisions],
        [a for r in recorded.values() for a in r.actions],
        [a for r in recorded.values() for a in r.acks],
        [c for r in recorded.values() for c in r.checkpoints],
        letters,
    )
    from spikeguard.reporting.goodput import Goodput, goodput

    for run_id in sorted(recorded):  # runs with steps but no decision yet have a goodput too
        info = report["runs"].pop(run_id, {"incidents": [], "actions": [], "checkpoints": 0})
        report["runs"][run_id] = {**info, "goodput": goodput(recorded[run_id])._asdict()}
    if args.export:
        from spikeguard.reporting import export_jsonl

        export_jsonl(recorded, args.export)
    written = _write_files(recorded, args.out, args.incidents) if args.out else []
    if args.json:
        print(json.dumps({**report, "files": written} if written else report, indent=2))
        return 0
    for run_id, info in report["runs"].items():
        print(
            f"run {run_id}: {len(info['incidents'])} incident(s), "
            f"{len(info['actions'])} action(s), {info['checkpoints']} checkpoint(s)"
        )
        if "goodput" in info:
            print(f"  {Goodput(**info['goodput'])}")
        for incident in info["incidents"]:
            print(
                f"  incident at step {incident['onset_step']} (epoch {incident['epoch']}): "
                f"{incident['type']}, {incident['urgency']}, {incident['steps']} step(s)"
            )
        for action in info["actions"]:
            print(
                f"  action {action['kind']:<18} at step {action['apply_at_step']:<7} "
                f"{action['status']:<10} {action['reason']}"
            )
    if report["dead_letters"]:
        print("dead letters: " + ", ".join(f"{t}: {n}" for t, n in report["dead_letters"].items()))
    for path in written:
        print(f"wrote {path}")
    return 0
