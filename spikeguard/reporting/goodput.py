"""A recorded run's goodput and badput, after Google's ml-goodput-measurement.

Counted from the recorded step events with the same tally the live Prometheus
series use (:class:`spikeguard.metrics.GoodputTally`), so the report and the
dashboard agree: steps kept (new progress), steps re-run after rollbacks,
updates skipped, and the wall time spent re-running. Batches skipped are those
of the data skips the trainer acknowledged as applied.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from spikeguard.metrics import GoodputTally, skipped_batches
from spikeguard.reporting.load import RunRecord


class Goodput(NamedTuple):
    steps_kept: int  # steps first run: the run's progress
    steps_rerun: int  # steps run again after rollbacks: badput
    batches_skipped: int  # steps' worth of data the applied skip windows dropped
    updates_skipped: int  # steps whose update the trainer skipped: badput
    updates_skipped_by_reason: dict[str, int]
    recovery_seconds: float  # wall time spent re-running steps
    ratio: float  # steps kept with their update applied, over all steps run

    def __str__(self) -> str:
        return (
            f"goodput {self.ratio:.1%}: {self.steps_kept} steps kept, {self.steps_rerun} "
            f"re-run after rollbacks ({self.recovery_seconds:.1f} s), {self.batches_skipped} "
            f"batches skipped, {self.updates_skipped} update(s) skipped"
        )


def goodput(run: RunRecord) -> Goodput:
    tally, reasons, seconds = GoodputTally(), Counter[str](), 0.0
    for event in run.steps:
        if event.rank != 0:
            continue  # every rank publishes the same step
        counted = tally.count(event)
        if counted is None:
            continue  # re-delivered
        seconds += counted[1]
        if event.update_skipped:
            reasons[event.skip_reason or "unknown"] += 1
    applied = {ack.action_id for ack in run.acks if ack.status.value == "applied"}
    skipped = {a.action_id: skipped_batches(a) for a in run.actions if a.action_id in applied}
    return Goodput(
        tally.first,
        tally.rerun,
        sum(skipped.values()),
        tally.skipped,
        dict(sorted(reasons.items())),
        round(seconds, 3),
        round(tally.ratio, 4),
    )
