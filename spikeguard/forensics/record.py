"""An incident's record, as the Guard writes it: the window's sample ids and the pre-onset checkpoint.

Plain JSON, no torch, so that ``spikeguard report`` can read it too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from spikeguard.errors import SpikeguardError


class IncidentFileError(SpikeguardError):
    """An incident file that is missing, unreadable, or not spikeguard's."""


@dataclass
class IncidentBatches:
    """What the Guard keeps about an incident so it can be inspected later."""

    run_id: str
    incident_id: str
    onset_step: int
    epoch: int
    checkpoint: (
        str | None
    )  # the checkpoint taken before the onset (relative: to the file's directory)
    checkpoint_step: int | None
    batches: list[dict] = field(
        default_factory=list
    )  # [{"step": int, "ids": [...]}], in step order

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)), encoding="utf-8")
        tmp.replace(path)
        return path

    @classmethod
    def read(cls, path: str | Path) -> "IncidentBatches":
        path = Path(path)
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
            record = cls(**body)
        except FileNotFoundError:
            raise IncidentFileError(f"{path}: no such incident file") from None
        except (ValueError, TypeError) as exc:
            raise IncidentFileError(f"{path}: not a spikeguard incident file ({exc})") from None
        if record.checkpoint and not Path(record.checkpoint).is_absolute():
            record.checkpoint = str(path.parent / record.checkpoint)  # the directory may have moved
        return record


def summary(directory: str | Path, run_id: str, incident_id: str) -> dict | None:
    """What ``directory`` holds about an incident, for the report: its record (batches, sample
    ids) and, when ``spikeguard inspect`` was run into the same directory, its top offenders."""
    directory = Path(directory)
    path = directory / f"{incident_id}.json"
    if not path.is_file():
        return None
    record = IncidentBatches.read(path)
    found = {
        "record": str(path),
        "batches": len(record.batches),
        "samples": sum(len(b["ids"]) for b in record.batches),
        "checkpoint_step": record.checkpoint_step,
        "top": None,
    }
    inspected = directory / f"inspect-{run_id}-{incident_id}.json"
    if inspected.is_file():
        try:
            found["top"] = json.loads(inspected.read_text(encoding="utf-8"))["top"][:5]
        except (ValueError, KeyError) as exc:
            raise IncidentFileError(f"{inspected}: not an inspect report ({exc})") from None
    return found


def skipped_samples(directory: str | Path, incident_id: str, params: dict) -> list | None:
    """The sample ids of a skip window's steps (``from_step..to_step``) as the incident's record
    holds them; the ``extra`` batches beyond were not drawn yet, so they have none. None when
    ``directory`` has no record of the incident."""
    path = Path(directory) / f"{incident_id}.json"
    if not path.is_file():
        return None
    try:
        first, last = int(params["from_step"]), int(params["to_step"])
    except (KeyError, TypeError, ValueError):
        return None
    record = IncidentBatches.read(path)
    return [
        sid for batch in record.batches if first <= batch["step"] <= last for sid in batch["ids"]
    ]
