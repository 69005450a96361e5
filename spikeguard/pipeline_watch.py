"""Does a pipeline judge this trainer's steps? Asked of the broker, said in one line.

On Kafka the workers are other processes; a trainer whose workers are not
running would publish steps that nobody judges, and (in lockstep) wait for
decisions that never come. Each component's worker is a member of the
consumer group ``{prefix}{component}``, so an empty group means that
component is not running. The watch says so when the trainer starts and
again whenever the set of missing components changes; training goes on with
the guard's local protections either way.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from spikeguard.components import COMPONENTS, DETECTOR_NAMES
from spikeguard.errors import BusError
from spikeguard.schemas import Topics

if TYPE_CHECKING:
    from spikeguard.bus.kafka import KafkaBus  # kafka-python is imported with it

log = logging.getLogger(__name__)


class PipelineWatch:
    """Checks the components' consumer groups now, and every ``interval_s`` after :meth:`start`."""

    def __init__(
        self,
        bus: "KafkaBus",
        topics: Topics,
        where: str,
        *,
        timeout_s: float = 5.0,
        interval_s: float = 15.0,
    ) -> None:
        self.bus, self.topics, self.where = bus, topics, where
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.groups = {f"{topics.prefix}{name}": name for name in COMPONENTS}
        # `spikeguard worker detectors` runs the four detectors under one group.
        self.cohosted = f"{topics.prefix}detectors"
        self.missing: list[str] | None = None  # None until a check succeeded
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> list[str] | None:
        """The components with no live worker (None if the broker did not say); logs changes."""
        try:
            live = self.bus.active_groups([*self.groups, self.cohosted], self.timeout_s)
        except BusError as exc:
            if not self._failed:  # once per outage, not once per check
                log.warning(
                    "spikeguard: could not check for pipeline workers on %s: %s", self.where, exc
                )
            self._failed = True
            return None
        self._failed = False
        missing = [
            name
            for group, name in self.groups.items()
            if group not in live and not (name in DETECTOR_NAMES and self.cohosted in live)
        ]
        if missing != self.missing:
            self._say(missing, first=self.missing is None)
        self.missing = missing
        return missing

    def _say(self, missing: list[str], first: bool) -> None:
        prefix = self.topics.prefix
        if len(missing) == len(self.groups):
            log.warning(
                "spikeguard: no pipeline workers are running on %s for topic prefix %r "
                "(no live consumer group for %s): training goes on with the local protections "
                "only (non-finite skip) until `spikeguard worker` runs",
                self.where,
                prefix,
                ", ".join(missing),
            )
        elif missing:
            log.warning(
                "spikeguard: the pipeline on %s (topic prefix %r) is incomplete, no worker "
                "runs for %s: those steps are not judged or acted on until one does",
                self.where,
                prefix,
                ", ".join(missing),
            )
        elif not first:
            log.warning(
                "spikeguard: every pipeline worker runs again on %s (topic prefix %r)",
                self.where,
                prefix,
            )

    def start(self) -> None:
        """Re-check every ``interval_s`` in a daemon thread (no thread when it is 0)."""
        if self.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="spikeguard-pipeline-watch", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:
                log.exception("spikeguard: pipeline check failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1)
