"""An alert that comes again and again is said once per episode; the rest are counted.

Issue 38: a LOW ``slow_rise`` answered with an alert line every ~80 steps for
40k steps (503 lines) is noise to a user. Each alert is still applied, acked,
handed to the user's handlers and counted in the summary.
"""

from __future__ import annotations

import logging

import pytest
from producers_helpers import Tiny, action, make_guard, send

from spikeguard.schemas import ActionKind


def _slow_rise(step: int) -> str:
    return (
        f"slow_rise at step {step} (confidence 0.{60 + step % 7}): low urgency (within the run's "
        "own wander at that time scale); watching, nothing changed"
    )


@pytest.mark.heavy  # (a Guard on a real loop: ~3 s on a loaded box)
def test_the_same_alert_every_few_steps_is_one_line_and_a_count(bus, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    tiny = Tiny(n=8 * 120)
    guard = make_guard(tiny, bus, tmp_path)
    handled: list[int] = []
    guard.on(ActionKind.ALERT, lambda a, g: handled.append(a.apply_at_step) or None)
    steps = [10 + 3 * i for i in range(30)]  # 10 .. 97
    send(
        bus,
        *(action(ActionKind.ALERT, s, severity="info", message=_slow_rise(s)) for s in steps),
        action(ActionKind.ALERT, 50, severity="warning", message="grad_norm at step 50: look"),
        guard=guard,
    )
    for batch in guard.data(tiny.loader):
        guard.step(tiny.loss(batch))
    summary = guard.close()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    alerts = [m for m in said if m.startswith("spikeguard alert (info)")]
    assert alerts == ["spikeguard alert (info): " + _slow_rise(10)], alerts
    counted = [m for m in said if "more time(s)" in m]
    assert len(counted) == 1 and "the same 29 more time(s) up to step 97" in counted[0], said
    assert "said at step 10" in counted[0]
    # another alert is said at once, and every alert still reached the handlers and the summary
    assert "spikeguard alert (warning): grad_norm at step 50: look" in said
    assert sorted(handled) == sorted(steps + [50])
    assert summary.notices["alert"] == 31
