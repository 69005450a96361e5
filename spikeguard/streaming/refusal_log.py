"""What a worker refused, logged at a bounded rate: a flood costs a few lines, not one per record.

Every refused record still goes to the DLQ with its reason, and
``spikeguard_dead_letters_total{component, error}`` counts it; the log says
the first few of each error class in full, then one line per ``interval_s``
with how many more of each class there were. Unsigned records (refused before
they are parsed) get a dead letter each up to a number per interval, then are
only counted: a dead letter costs the worker a send, and a flood would
otherwise cost it a send per record. 100,000 unsigned records made
100,000 WARNING lines (24 MB of log) and the logging was a third of the
time spent dropping them.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Callable


class RefusalLog:
    """``said(error)`` before logging a refusal in full; ``summary(now)`` after each batch."""

    def __init__(
        self,
        log: logging.Logger,
        group: str,
        in_full: int = 5,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log, self.group = log, group
        self.in_full = in_full  # per error class and interval
        self.interval_s = interval_s
        self.clock = clock
        self._said: Counter[str] = Counter()
        self._unsaid: Counter[str] = Counter()
        self._written = 0  # unsigned records' dead letters written in this interval
        self._unwritten = 0
        self._since = clock()

    def write_unsigned(self, letters_per_interval: int) -> bool:
        """True when an unsigned record's dead letter is still written in this interval; beyond
        ``letters_per_interval`` they are counted only (writing each one is most of a flood's cost)."""
        if self._written < letters_per_interval:
            self._written += 1
            return True
        self._unwritten += 1
        return False

    def said(self, error: str) -> bool:
        """True when this refusal is to be logged in full; else it is only counted."""
        if self._said[error] < self.in_full:
            self._said[error] += 1
            return True
        self._unsaid[error] += 1
        return False

    def summary(self) -> None:
        """Once an interval is over: one line with the refusals not logged in it, and start anew."""
        now = self.clock()
        if now - self._since < self.interval_s:
            return
        if self._unsaid:
            self.log.warning(
                "%s: %d more records refused in the last %.0f s, not logged one by one (%s)%s; "
                "spikeguard_dead_letters_total counts them all",
                self.group,
                sum(self._unsaid.values()),
                now - self._since,
                ", ".join(f"{error}: {n}" for error, n in self._unsaid.most_common()),
                f", {self._unwritten} of them unsigned and not written to the DLQ"
                if self._unwritten
                else "",
            )
        self._said.clear()
        self._unsaid.clear()
        self._written = self._unwritten = 0
        self._since = now
