"""The Guard's own I/O failures: reported once, counted, never fatal to the run it protects.

A full disk, a read-only or vanished checkpoint directory: the Guard's own
writes (checkpoints, the action ledger, incident records) can fail while the
training itself is fine. Such a failure must not end the run: what failed is
switched to "best effort", the rest of the Guard goes on (local skips,
actions, publishing), and the user hears about it once per kind of write, not
once per step. When the same kind of write works again, that is said once too.

Every failure is counted in ``spikeguard_trainer_io_errors_total{what=...}``
and in :attr:`IOFaults.counts`, which the Guard exposes in its counters.

>>> faults = IOFaults()
>>> faults.attempt(IOKind.LEDGER, lambda: None)
True
"""

from __future__ import annotations

import errno
import logging
from enum import Enum
from typing import Any, Callable

from spikeguard.metrics import Metrics, default_metrics

log = logging.getLogger("spikeguard.producers.guard")  # the logger users already see


class IOKind(str, Enum):
    """What the Guard was writing (the metric's ``what`` label; fixed up front)."""

    CHECKPOINT = "checkpoint"
    LEDGER = "ledger"
    INCIDENT = "incident"


_CONSEQUENCE = {
    IOKind.CHECKPOINT: "no new rollback target until writes work again (older checkpoints still serve)",
    IOKind.LEDGER: "applied actions are still remembered in memory and in the next checkpoint that "
    "can be written; a crash before then could re-apply one",
    IOKind.INCIDENT: "the incident's forensic record is incomplete; recovery is unaffected",
}


def describe(exc: BaseException) -> str:
    """``exc`` in a few words, with the disk-full case said plainly."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"disk full ({exc})"
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"not writable ({exc})"
    return f"{type(exc).__name__}: {exc}"


class IOFaults:
    """Which of the Guard's writes are failing, and the one report of each."""

    def __init__(self, run_id: str = "", metrics: Metrics | None = None) -> None:
        self.run_id = run_id
        self._errors_total = (metrics or default_metrics()).trainer_io_errors
        self.counts: dict[str, int] = {kind.value: 0 for kind in IOKind}
        self._failing: set[IOKind] = set()

    def failing(self, kind: IOKind) -> bool:
        return kind in self._failing

    def failed(self, kind: IOKind, exc: BaseException) -> None:
        """Record one failed write of ``kind``; the first of a streak is logged (ERROR)."""
        self.counts[kind.value] += 1
        self._errors_total.labels(kind.value).inc()
        if kind not in self._failing:
            self._failing.add(kind)
            log.error(
                "spikeguard: run %s: %s write failed: %s; training goes on: %s "
                "(further %s failures are counted in spikeguard_trainer_io_errors_total, "
                "not logged)",
                self.run_id,
                kind.value,
                describe(exc),
                _CONSEQUENCE[kind],
                kind.value,
            )

    def worked(self, kind: IOKind) -> None:
        """A write of ``kind`` succeeded: if it was failing, say once that it works again."""
        if kind in self._failing:
            self._failing.discard(kind)
            log.warning(
                "spikeguard: run %s: %s writes work again (%d failed meanwhile)",
                self.run_id,
                kind.value,
                self.counts[kind.value],
            )

    def attempt(self, kind: IOKind, write: Callable[[], Any]) -> bool:
        """Run ``write()``; an OSError is recorded instead of raised. True when it worked."""
        try:
            write()
        except OSError as exc:
            self.failed(kind, exc)
            return False
        self.worked(kind)
        return True
