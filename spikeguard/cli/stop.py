"""``spikeguard stop RUN_ID``: an operator asks a run's trainer to stop (Kafka).

With a signing key the trainer obeys only signed actions, and refuses a
state-changing one that names no step it published itself (a forged decision
would otherwise get the actuator to sign anything). So the operator's STOP is
built like the pipeline's: signed with SPIKEGUARD_SIGNING_KEY, with the
evidence of the run's newest step as the trainer published it on the steps
topic. The trainer applies it at its next step (it remembers its last 4096
steps), saves its state as a checkpoint would and ends its loop
(``guard.should_stop``). ``--wait`` waits for the trainer's answer (Ack).
"""

from __future__ import annotations

import argparse
import time

from spikeguard.cli._common import add_settings_flags, settings_from


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stop",
        help="ask a run's trainer to stop (signed, with evidence)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_id", help="the run to stop")
    parser.add_argument(
        "--reason", default="operator stop", help="said in the trainer's log and ack"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="wait this long for the trainer's ack (0: do not wait; default 30)",
    )
    add_settings_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spikeguard.errors import BusError, ConfigError
    from spikeguard.producers.actions import operator_evidence
    from spikeguard.runtime import make_bus
    from spikeguard.schemas import (
        Ack,
        Action,
        ActionKind,
        StepEvent,
        Topics,
        action_id,
        encode,
    )
    from spikeguard.schemas.signing import sign_action
    from spikeguard.trust import ensure_signing_key

    settings = settings_from(args)
    if not settings.bootstrap_servers:
        raise ConfigError(
            "stop needs the run's broker (--bootstrap-servers / SPIKEGUARD_BOOTSTRAP_SERVERS): "
            "an embedded pipeline lives inside the trainer's process"
        )
    settings = ensure_signing_key(settings, "spikeguard stop")
    topics = Topics(settings.topic_prefix)
    bus = make_bus(settings)
    try:
        newest = None
        for record in bus.read_all(topics.steps):
            if (
                record.key is not None and record.key != args.run_id.encode()
            ):  # another run: skip the parse
                continue
            try:
                event = record.decoded(StepEvent)
            except Exception:  # noqa: BLE001 - not a step of this run: the DLQ is the workers' business
                continue
            newer = newest is None or (event.epoch, event.step) > (newest.epoch, newest.step)
            if event.run_id == args.run_id and newer:
                newest = event
        if newest is None:
            raise BusError(
                f"no step of run {args.run_id!r} on {topics.steps}: nothing to name as evidence"
            )
        stop = Action(
            action_id=action_id(
                f"operator-stop/{args.run_id}/{newest.epoch}/{newest.step}", "stop"
            ),
            run_id=args.run_id,
            kind=ActionKind.STOP,
            apply_at_step=newest.step + 1,
            params={"reason": args.reason},
            evidence=operator_evidence(newest),
            reason=args.reason,
        )
        key = settings.keys()
        if key is not None:  # an operator's stop is an action: the actuator's key signs it
            stop = sign_action(stop, key)
        producer = bus.producer()
        producer.publish(topics.actions, encode(stop), key=args.run_id)
        producer.flush()
        print(
            f"stop {stop.action_id} sent to run {args.run_id} (evidence: step {newest.step} of epoch "
            f"{newest.epoch})",
            flush=True,
        )
        deadline = time.monotonic() + max(0.0, args.wait)
        while time.monotonic() < deadline:
            for record in bus.read_all(topics.acks):
                try:
                    ack = record.decoded(Ack)
                except Exception:  # noqa: BLE001
                    continue
                if ack.action_id == stop.action_id:
                    print(f"run {args.run_id}: {ack.status.value} at step {ack.step}: {ack.result}")
                    return 0 if ack.status.value in ("applied", "duplicate") else 1
            time.sleep(1.0)
        if args.wait > 0:
            print(f"run {args.run_id}: no answer within {args.wait:g} s (is its trainer running?)")
            return 1
        return 0
    finally:
        bus.close()
