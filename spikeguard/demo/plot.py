"""The demo's pictures: the same PNG and HTML report as ``spikeguard report --out``.

A guarded demo reads its run back from the runtime's bus (steps, verdicts,
decisions, actions, acks, checkpoints), so the figure shows exactly what the
pipeline recorded; an unguarded one has only its losses to show.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from spikeguard.reporting import RunRecord, build_timeline, load_bus
from spikeguard.reporting.figure import draw
from spikeguard.reporting.page import write
from spikeguard.schemas import StepEvent

if TYPE_CHECKING:
    from spikeguard.demo.run import DemoOutcome


def report_outcome(outcome: "DemoOutcome", png: str, runtime: Any = None) -> str:
    """Write ``png`` and the HTML page beside it (same name, ``.html``); returns the page's path."""
    if runtime is not None:
        (record,) = load_bus(runtime.bus, runtime.topics, source="the demo's bus").values()
    else:
        record = RunRecord(
            f"demo-{outcome.fault}-{outcome.seed}-unguarded",
            steps=[
                StepEvent(run_id="unguarded", step=step, epoch=epoch, loss=loss, time=0.0)
                for step, epoch, loss in outcome.losses
            ],
        )
    timeline = build_timeline(record)
    guard = "guarded" if outcome.guarded else "no guard"
    draw(
        timeline, png, title=f"spikeguard demo: {outcome.fault} fault, {guard}, seed {outcome.seed}"
    )
    page = str(Path(png).with_suffix(".html"))
    write(timeline, page, png)
    return page
