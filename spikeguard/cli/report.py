"""``spikeguard report``: what happened to each run, from the recorded topics.

Incidents (onset, type, worst urgency, length), the actions taken and how the
trainers answered them, checkpoints, and dead letters: the audit trail.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

from spikeguard.bus import EmbeddedBus
from spikeguard.cli._common import add_settings_flags, settings_from
from spikeguard.cli.replay import read_topic
from spikeguard.schemas import Ack, Action, CheckpointEvent, DeadLetter, Decision, Topics, Urgency

_URGENCY = {u: i for i, u in enumerate(Urgency)}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="incidents, actions and acks per run", description=__doc__
    )
    parser.add_argument("--data-dir", help="a directory recorded by the embedded bus (else Kafka)")
    parser.add_argument("--run-id", action="append", help="only these runs (repeatable)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of text")
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def summarise(decisions, actions, acks, checkpoints, letters) -> dict:
    runs: dict[str, dict] = defaultdict(lambda: {"incidents": {}, "actions": [], "checkpoints": 0})
    for d in decisions:
        if not d.incident_id:
            continue
        incident = runs[d.run_id]["incidents"].setdefault(d.incident_id, {
            "onset_step": d.incident_onset_step if d.incident_onset_step is not None else d.step,
            "epoch": d.epoch, "type": d.type.value, "urgency": d.urgency.value, "steps": 0,
        })
        incident["steps"] += 1
        if _URGENCY[d.urgency] > _URGENCY[Urgency(incident["urgency"])]:
            incident["urgency"] = d.urgency.value
    answers = {a.action_id: a.status.value for a in acks}
    for a in actions:
        runs[a.run_id]["actions"].append({
            "kind": a.kind.value, "apply_at_step": a.apply_at_step,
            "status": answers.get(a.action_id, "no ack"), "reason": a.reason,
        })
    for c in checkpoints:
        runs[c.run_id]["checkpoints"] += 1
    return {
        "runs": {run: {**info, "incidents": list(info["incidents"].values())}
                 for run, info in sorted(runs.items())},
        "dead_letters": dict(Counter(letter.source_topic for letter in letters)),
    }


def run(args: argparse.Namespace) -> int:
    from spikeguard.runtime import make_bus

    settings = settings_from(args)
    topics = Topics(settings.topic_prefix)
    bus = EmbeddedBus(data_dir=args.data_dir) if args.data_dir else make_bus(settings)
    runs = set(args.run_id) if args.run_id else None
    report = summarise(
        read_topic(bus, topics.decisions, Decision, runs)[0],
        read_topic(bus, topics.actions, Action, runs)[0],
        read_topic(bus, topics.acks, Ack, runs)[0],
        read_topic(bus, topics.checkpoints, CheckpointEvent, runs)[0],
        [letter for letter in read_topic(bus, topics.dlq, DeadLetter, None)[0]],
    )
    bus.close()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for run_id, info in report["runs"].items():
        print(f"run {run_id}: {len(info['incidents'])} incident(s), "
              f"{len(info['actions'])} action(s), {info['checkpoints']} checkpoint(s)")
        for incident in info["incidents"]:
            print(f"  incident at step {incident['onset_step']} (epoch {incident['epoch']}): "
                  f"{incident['type']}, {incident['urgency']}, {incident['steps']} step(s)")
        for action in info["actions"]:
            print(f"  action {action['kind']:<18} at step {action['apply_at_step']:<7} "
                  f"{action['status']:<10} {action['reason']}")
    if report["dead_letters"]:
        print("dead letters: " + ", ".join(f"{t}: {n}" for t, n in report["dead_letters"].items()))
    return 0
