"""kafka-python's slow-IO-step WARNINGs: explained once at INFO, then only at DEBUG."""

from __future__ import annotations

import logging

from spikeguard.bus.kafka import SLOW_IO_STEPS

# What kafka-python 3.x's NetworkSelector logs (kafka/net/selector.py), verbatim but for the task.
SLOW = (
    "Task <Task x> ran for 0.150s (>0.100s threshold). It is blocking the event loop -- likely "
    "a tight sync loop inside a coroutine. Other pollers will time out."
)


def test_slow_io_steps_are_explained_once_and_not_repeated_as_warnings(caplog, monkeypatch):
    monkeypatch.setattr(SLOW_IO_STEPS, "seen", 0)
    selector = logging.getLogger("kafka.net.selector")
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            selector.warning(SLOW)
        selector.warning("Task %s left RUNNING after step; demoting to UNSCHEDULED", "t")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["Task t left RUNNING after step; demoting to UNSCHEDULED"]  # others pass
    (note,) = [r for r in caplog.records if r.levelno == logging.INFO]
    assert "not a fault" in note.getMessage() and SLOW_IO_STEPS.seen == 3
    with caplog.at_level(logging.DEBUG, logger="kafka"):
        selector.warning(SLOW)
    assert caplog.records[-1].getMessage() == SLOW  # with kafka's logger at DEBUG, all of them
