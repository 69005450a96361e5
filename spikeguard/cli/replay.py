"""``spikeguard replay``: re-judge recorded runs, and show what would change.

Reads the recorded steps, checkpoints and acks (from Kafka, or from a directory the
embedded bus recorded with ``data_dir``), runs the whole pipeline over them
offline and deterministically, and prints how the new decisions and actions
differ from the recorded ones: added (+), removed (-), changed (~), naming
the rollbacks and LR restores that appear or vanish.

The judgement uses the settings the run was recorded with (a recording keeps
them in ``_settings.json``), so a replay with no flags shows no differences;
``--set NAME=VALUE`` changes one of them to see what it would have done.
``--current-settings`` uses today's settings instead. ``--publish`` writes the
new decisions and actions under ``--prefix`` (default ``replay.``), leaving
the originals untouched.

With the pipeline's key (``SPIKEGUARD_SIGNING_KEY``, or the role keys) every
recorded record is checked as its live consumer checks it: one its producer
did not sign is left out of the replay and counted, per topic. Without a key
nothing can be checked; the records that carry no signature are counted.

  spikeguard replay --data-dir run/ --set fusion.threshold=0.8
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import cast

from spikeguard.bus import EmbeddedBus
from spikeguard.cli._common import add_settings_flags, settings_from
from spikeguard.errors import SchemaError, SpikeguardError
from spikeguard.schemas import Ack, Action, CheckpointEvent, Decision, StepEvent, Topics, encode


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="re-judge recorded runs under new settings",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data-dir", help="a directory recorded by the embedded bus (else Kafka)")
    parser.add_argument("--run-id", action="append", help="only these runs (repeatable)")
    parser.add_argument("--prefix", default="replay.", help="topic prefix for --publish")
    parser.add_argument("--publish", action="store_true", help="publish new decisions and actions")
    parser.add_argument("--out", help="also write the new decisions (anomalous) as JSONL here")
    parser.add_argument(
        "--current-settings",
        action="store_true",
        help="judge with today's settings, not the recorded ones",
    )
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def read_topic(bus, topic, model, runs, key=None, refused: Counter | None = None):
    """The records of ``topic`` as ``model``, and how many could not be read.

    With ``key``, a record its producer did not sign is left out and counted in ``refused``
    (by topic); without one, a record with no signature is kept and counted there.
    """
    from spikeguard.schemas.signing import SIGNED_TYPES, signature_problem

    events, bad = [], 0
    signed = model in SIGNED_TYPES
    for record in bus.read_all(topic, timeout=30):
        try:
            event = record.decoded(model)
        except SchemaError:
            bad += 1  # the DLQ already holds what the live pipeline could not read
            continue
        if runs is not None and event.run_id not in runs:
            continue
        if signed and refused is not None:
            if key is not None and signature_problem(event, key) is not None:
                refused[topic] += 1
                continue
            if key is None and not event.signature:
                refused[topic] += 1
        events.append(event)
    return events, bad


def signatures_line(flagged: Counter, checked: bool, topics: Topics) -> str:
    """One line: how many records the signature check left out (or, with no key, found unsigned)."""
    total = sum(flagged.values())
    per_topic = ", ".join(
        f"{topic.removeprefix(topics.prefix)} {count}" for topic, count in sorted(flagged.items())
    )
    if checked:
        return (
            f"signatures checked: {total} record(s) not signed by their producer's key left out"
            + (f" ({per_topic})" if total else "")
        )
    return "signatures NOT checked (no signing key): " + (
        f"{total} record(s) carry no signature ({per_topic})"
        if total
        else "every record carries a signature, unverified"
    )


def run(args: argparse.Namespace) -> int:
    from spikeguard.runtime import make_bus
    from spikeguard.lab.backtest import replay_events

    from spikeguard.reporting import recorded_settings
    from spikeguard.reporting.diff import diff_actions, diff_decisions, render
    from spikeguard.settings import parse_assignments

    recorded_with = None
    if args.data_dir and not args.current_settings:
        recorded_with = recorded_settings.load(args.data_dir)
    base: dict = {}
    if recorded_with is not None:
        flagged = parse_assignments(args.set)
        base = {k: v for k, v in recorded_with.items() if k not in flagged}
    settings = settings_from(args, **base)
    source = Topics(settings.topic_prefix)
    bus = EmbeddedBus(data_dir=args.data_dir) if args.data_dir else make_bus(settings)
    runs = set(args.run_id) if args.run_id else None
    key = settings.keys()
    refused: Counter[str] = Counter()
    steps, bad = read_topic(bus, source.steps, StepEvent, runs, key, refused)
    checkpoints, _ = read_topic(bus, source.checkpoints, CheckpointEvent, runs, key, refused)
    recorded, _ = read_topic(bus, source.decisions, Decision, runs, key, refused)
    recorded_actions, _ = read_topic(bus, source.actions, Action, runs, key, refused)
    acks, _ = read_topic(
        bus, source.acks, Ack, runs, key, refused
    )  # the actuator hears what the trainer did
    print(signatures_line(refused, key is not None, source))
    if not steps:
        raise SpikeguardError(f"no step events on {source.steps} to replay")
    found = replay_events(steps, checkpoints, settings, acks)
    decisions = cast(list[Decision], found[source.decisions])
    actions = cast(list[Action], found[source.actions])

    def anomalous(items):
        return {(d.run_id, d.epoch, d.step): d.type.value for d in items if d.is_anomaly}

    before, after = anomalous(recorded), anomalous(decisions)
    print(
        f"replayed {len(steps)} steps of {len({s.run_id for s in steps})} run(s)"
        f" ({bad} unreadable records skipped)"
    )
    print(
        f"anomalous decisions: recorded {len(before)}, now {len(after)}; "
        f"new {len(after.keys() - before.keys())}, gone {len(before.keys() - after.keys())}, "
        f"type changed {sum(before[k] != after[k] for k in before.keys() & after.keys())}"
    )
    print(
        f"actions now: {len(actions)} ({', '.join(sorted({a.kind.value for a in actions})) or 'none'})"
    )
    if recorded_with is not None:
        changed = sorted(parse_assignments(args.set))
        print(
            "judged with the recorded settings"
            + (f", changed: {', '.join(changed)}" if changed else "")
        )
    else:
        print(
            "judged with today's settings"
            + ("" if args.current_settings else " (no recorded settings found)")
        )
    lines = render(diff_decisions(recorded, decisions), diff_actions(recorded_actions, actions))
    if lines[-1] == "no differences" and args.set:
        # The change was applied (the line above names it); it moved no decision on this run.
        lines[-1] = f"no differences: with {', '.join(args.set)} every step is judged as recorded"
    for line in lines:
        print(line)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as out:
            for decision in decisions:
                if decision.is_anomaly or decision.preventive:
                    out.write(decision.model_dump_json() + "\n")
    if args.publish:
        target = Topics(args.prefix)
        publish_bus = bus if args.data_dir else make_bus(settings)
        publish_bus.create_topics([target.decisions, target.actions])
        producer = publish_bus.producer()
        for event in decisions:
            producer.publish(target.decisions, encode(event), key=event.run_id)
        for action in actions:
            producer.publish(target.actions, encode(action), key=action.run_id)
        producer.flush()
        print(f"published to {target.decisions} and {target.actions}", file=sys.stderr)
    bus.close()
    return 0
