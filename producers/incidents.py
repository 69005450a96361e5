"""What the Guard keeps about each incident so that ``spikeguard inspect`` can replay it later.

For every step the data wrapper reports which sample ids its batches held
(``forensics.provenance``); the last ``window`` steps are kept. When the first
action of a new incident arrives, the Guard writes
``<checkpoint_dir>/incidents/<incident>.json``: the ids of the batches from
``lookback`` steps before the onset to now, and the newest healthy checkpoint
at or before the onset. That checkpoint is hard-linked (copied where links
are not possible) next to the file, because the rotation would delete it
long before a person gets to look.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from spikeguard.forensics.provenance import SampleIdTap, SampleIds, StepSamples
from spikeguard.forensics.record import IncidentBatches
from spikeguard.producers.io_faults import IOFaults, IOKind

log = logging.getLogger(__name__)

LOOKBACK = (
    8  # steps before the onset whose batches may have caused it (the skip windows reach as far)
)


class IncidentRecorder:
    def __init__(
        self,
        directory: Path,
        run_id: str,
        window: int = 512,
        lookback: int = LOOKBACK,
        max_files: int = 100,
        faults: IOFaults | None = None,
    ) -> None:
        self.directory = Path(directory) / "incidents"
        self.run_id = run_id
        self.samples = StepSamples(window)
        self.lookback = lookback
        self.max_files = max_files  # a run with a thousand incidents keeps the first hundred
        self.tap: SampleIdTap | None = None
        self._pending: list = []
        self.written: dict[str, Path] = {}
        self.faults = faults if faults is not None else IOFaults(run_id)

    def attach(self, loader: Any, sample_ids: SampleIds | None = None) -> None:
        self.tap = SampleIdTap(loader, sample_ids)

    def restart(self) -> None:
        if self.tap is not None:
            self.tap.restart()
        self._pending = []

    def batch(self, batch: Any, used: bool = True) -> None:
        """A batch the loader yielded; ``used=False`` for one the wrapper dropped."""
        if self.tap is None:
            return
        ids = self.tap.ids(batch)
        if used and ids is not None:
            self._pending.extend(ids)

    def step(self, step: int) -> None:
        """The step is done: the batches read since the last step were its (micro-)batches."""
        if self._pending:
            self.samples.record(step, self._pending)
        self._pending = []

    def incident(
        self,
        incident_id: str | None,
        onset_step: int,
        epoch: int,
        now_step: int,
        checkpoint: Callable[[int], Any],
    ) -> Path | None:
        """Write the incident's file once; ``checkpoint(max_step)`` finds a healthy CheckpointInfo.

        A write that fails (full disk, read-only directory) is reported through ``faults``
        and tried again at the incident's next action; the recovery never waits on it."""
        if not incident_id or incident_id in self.written or len(self.written) >= self.max_files:
            return None
        try:
            path = self._write(incident_id, onset_step, epoch, now_step, checkpoint)
        except OSError as exc:
            self.faults.failed(IOKind.INCIDENT, exc)
            return None
        self.faults.worked(IOKind.INCIDENT)
        return path

    def _write(
        self,
        incident_id: str,
        onset_step: int,
        epoch: int,
        now_step: int,
        checkpoint: Callable[[int], Any],
    ) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        info = checkpoint(onset_step - 1)
        kept = None
        if info is not None:
            kept = self.directory / f"{incident_id}.pt"
            try:
                if not kept.exists():
                    os.link(info.path, kept)
            except OSError:
                shutil.copyfile(info.path, kept)
        record = IncidentBatches(
            self.run_id,
            incident_id,
            onset_step,
            epoch,
            kept.name if kept else None,
            info.step if info else None,
            self.samples.between(onset_step - self.lookback, now_step),
        )
        path = record.write(self.directory / f"{incident_id}.json")
        self.written[incident_id] = path
        log.info(
            "incident %s: %d batches' sample ids and the checkpoint of step %s kept in %s",
            incident_id,
            len(record.batches),
            record.checkpoint_step,
            path,
        )
        return path
