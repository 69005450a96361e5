"""Reading a recorded run: from the embedded bus's directory, a JSONL export, or a bus.

A JSONL export (``spikeguard report --export``) has one line per record,
``{"topic": "steps", "event": {...}}``, the topic named without its prefix.
A source that holds no step events is an error: an empty report of a
mistyped directory would look like a healthy run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from pydantic import BaseModel

from spikeguard.errors import SchemaError, SpikeguardError
from spikeguard.schemas import (
    Ack,
    Action,
    ActionKind,
    CheckpointEvent,
    Decision,
    StepEvent,
    StepVerdicts,
    Topics,
    Verdict,
    decode,
)

if TYPE_CHECKING:
    from spikeguard.bus import Bus

MODELS: dict[str, type[BaseModel]] = {
    "steps": StepEvent,
    "verdicts": Verdict,
    "decisions": Decision,
    "actions": Action,
    "acks": Ack,
    "checkpoints": CheckpointEvent,
}


class ReportError(SpikeguardError):
    """The source is not a recorded run (missing, empty, or not spikeguard's)."""


@dataclass
class RunRecord:
    """Everything recorded about one run, each list in the order it was recorded."""

    run_id: str
    steps: list[StepEvent] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    checkpoints: list[CheckpointEvent] = field(default_factory=list)
    unreadable: int = 0  # records that did not decode (the DLQ has them)

    def add(self, name: str, event: BaseModel) -> None:
        if isinstance(event, Action) and event.kind is ActionKind.PULSE:
            return  # the actuator telling a live trainer it is judged: nothing done to the run
        getattr(self, name).append(event)


def _collect(pairs: Iterable[tuple[str, BaseModel]], runs: set[str] | None) -> dict[str, RunRecord]:
    found: dict[str, RunRecord] = {}
    for name, event in pairs:
        run_id = event.run_id  # type: ignore[attr-defined]
        if runs is not None and run_id not in runs:
            continue
        record = found.get(run_id)
        if record is None:
            record = found[run_id] = RunRecord(run_id)
        record.add(name, event)
    found = {run: record for run, record in found.items() if record.steps}
    return dict(sorted(found.items()))


def _require(
    found: dict[str, RunRecord], source: str, runs: set[str] | None
) -> dict[str, RunRecord]:
    if not found:
        which = f" of run(s) {', '.join(sorted(runs))}" if runs else ""
        raise ReportError(f"{source}: no step events{which}; is this a recorded spikeguard run?")
    return found


def load_bus(
    bus: "Bus", topics: Topics, runs: set[str] | None = None, source: str = "the bus"
) -> dict[str, RunRecord]:
    """Every recorded run on ``bus`` under ``topics``' prefix."""

    def pairs():
        for name, model in MODELS.items():
            for record in bus.read_all(topics.prefix + name, timeout=30):
                try:
                    yield name, record.decoded(model)
                except SchemaError:
                    continue  # the live pipeline sent it to the DLQ already
        # A co-hosted detector worker sends each step's verdicts as one record.
        for record in bus.read_all(topics.step_verdicts, timeout=30):
            try:
                packed = record.decoded(StepVerdicts)
            except SchemaError:
                continue
            for verdict in packed.verdicts:
                yield "verdicts", verdict

    return _require(_collect(pairs(), runs), source, runs)


def load_directory(
    directory: str | os.PathLike, prefix: str = Topics().prefix, runs: set[str] | None = None
) -> dict[str, RunRecord]:
    """A directory the embedded bus recorded (``data_dir``)."""
    from spikeguard.bus import EmbeddedBus

    path = Path(directory)
    if not path.is_dir():
        raise ReportError(f"{path}: no such directory")
    steps_dir = path / f"{prefix}steps"
    if not steps_dir.is_dir():
        raise ReportError(
            f"{path}: not a recording of the embedded bus "
            f"(no {prefix}steps/ in it; another --topic-prefix?)"
        )
    partitions = 1 + max(
        (
            int(f.stem)
            for d in path.iterdir()
            if d.is_dir()
            for f in d.glob("*.jsonl")
            if f.stem.isdigit()
        ),
        default=0,
    )
    bus = EmbeddedBus(partitions=partitions, data_dir=path)
    try:
        return load_bus(bus, Topics(prefix), runs, source=str(path))
    finally:
        bus.close()


def load_jsonl(file: str | os.PathLike, runs: set[str] | None = None) -> dict[str, RunRecord]:
    """A JSONL export: ``{"topic": NAME, "event": {...}}`` per line."""
    path = Path(file)
    if not path.is_file():
        raise ReportError(f"{path}: no such file")

    def pairs():
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                    name = item["topic"]
                    model = MODELS[name]
                    event = decode(json.dumps(item["event"]).encode(), model)
                except (ValueError, KeyError, TypeError, SchemaError) as exc:
                    raise ReportError(
                        f"{path}:{number}: not a spikeguard export line ({exc})"
                    ) from None
                yield name, event

    return _require(_collect(pairs(), runs), str(path), runs)


def export_jsonl(runs: dict[str, RunRecord], file: str | os.PathLike) -> int:
    """Write ``runs`` as a JSONL export; returns the number of lines."""
    lines = 0
    with open(file, "w", encoding="utf-8") as out:
        for record in runs.values():
            for name in MODELS:
                for event in getattr(record, name):
                    out.write('{"topic": "%s", "event": %s}\n' % (name, event.model_dump_json()))
                    lines += 1
    return lines
