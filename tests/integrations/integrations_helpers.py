"""Helpers of the integration tests: actions on a bare bus, what the guard published."""

from __future__ import annotations

import itertools
import time

from spikeguard.schemas import Ack, Action, ActionKind, StepEvent, Topics, decode, encode

_ids = itertools.count()


def action(kind: ActionKind, at: int, run_id: str, **params) -> Action:
    return Action(
        action_id=f"a-integ-{next(_ids)}", run_id=run_id, kind=kind, apply_at_step=at, params=params
    )


def send(bus, guard, *actions: Action) -> None:
    """Publish ``actions`` and wait until the guard's inbox has them (so they are due on time)."""
    producer = bus.producer()
    before = guard.inbox._handed
    for a in actions:
        producer.publish(Topics().actions, encode(a), key=a.run_id)
    deadline = time.monotonic() + 10
    while guard.inbox._handed < before + len(actions) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert guard.inbox._handed >= before + len(actions), (
        "the guard's inbox did not receive the actions"
    )


def acks(bus) -> list[Ack]:
    return [decode(r.value, Ack) for r in bus.read_all(Topics().acks)]


def steps(bus) -> list[StepEvent]:
    """The step events published (read after the run: closing the guard flushed them)."""
    return [decode(r.value, StepEvent) for r in bus.read_all(Topics().steps)]
