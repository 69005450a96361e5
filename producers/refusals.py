"""What the pipeline refused of this run: read from the DLQ, said in one WARNING per kind.

A record that claims to be this run's but that the workers refused (a
genuine record of an earlier session replayed, a step jumping the run far
ahead, a step with a bad signature) goes to the DLQ with the reason, keyed by
the run id. The trainer reads those letters (from the DLQ's start when it
starts: a consumer group of its own session, never committed, that skips
the letters written before the session began) and says the
first of each kind in one WARNING, counting the rest: an attack on its run,
or its own steps refused, is seen where the run is watched.

It is also the evidence :class:`~spikeguard.producers.protection.ProtectionWatch`
names when the run is not judged: this trainer's own steps refused with a bad
signature mean its key differs from the workers'.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from spikeguard.bus import Bus
from spikeguard.errors import SchemaError
from spikeguard.schemas import DeadLetter, Topics

log = logging.getLogger(__name__)

#: The error classes a trainer is told about, and what each means for its run.
MEANING = {
    "RecordOfOtherSession": "a genuine record of another trainer session of this run id (replayed, "
    "or another trainer with the same run id)",
    "StepOutOfOrder": "a step behind the run, or further ahead than a trainer runs (forged with "
    "the trainer key, replayed or corrupt)",
    "StepNotAuthenticated": "a step without a valid signature of the run's key",
    "RecordNotAuthenticated": "a record without a valid signature",
    "RunEventNotAuthenticated": "a run start or end without a valid signature",
}


class RefusalWatch:
    """This run's dead letters, counted by error class; the first of each said in one WARNING."""

    def __init__(self, bus: Bus, topics: Topics, run_id: str, session: str) -> None:
        self.run_id, self.session = run_id, session
        # Letters from this session's start on (a little clock skew allowed): read from the DLQ's
        # start, since a group that starts at the end would miss those written while it joins.
        self.since_ms = int((time.time() - 5.0) * 1000)
        bus.create_topics([topics.dlq])
        self._consumer = bus.consumer(
            f"spikeguard-guard.{run_id}.{session}.dlq", [topics.dlq], from_beginning=True
        )
        self.counts: Counter[str] = Counter()
        self.own_bad_signatures = 0  # this session's own steps refused with a bad signature
        # Its own thread: a new consumer group's first polls can block while it joins (kafka-python
        # waits for the coordinator beyond the poll's timeout), and the action inbox must never
        # wait on that. Only this thread touches the consumer until it has stopped.
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spikeguard-refusals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as exc:  # noqa: BLE001 - reading the DLQ must never hurt the run
                log.debug("spikeguard: reading the DLQ failed: %r", exc)
                self._stop.wait(1.0)

    def poll(self) -> None:
        # (a short wait, not 0: a consumer that polls with none may take long to join its group)
        for record in self._consumer.poll(max_records=500, timeout=0.2):
            if record.key_text != self.run_id or 0 < record.timestamp_ms < self.since_ms:
                continue
            try:
                letter = record.decoded(DeadLetter)
            except SchemaError:
                continue
            self._note(letter)

    def _note(self, letter: DeadLetter) -> None:
        error = letter.error
        if error not in MEANING:
            return
        if "bad signature" in letter.reason and f'"session":"{self.session}"' in letter.value:
            self.own_bad_signatures += 1
        self.counts[error] += 1
        if self.counts[error] == 1:
            log.warning(
                "spikeguard: run %s: the pipeline (%s) refused %s to the DLQ: %s. This run's state "
                "is unchanged; further ones are counted, not logged",
                self.run_id,
                letter.consumer or "a worker",
                MEANING[error],
                letter.reason,
            )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        if not self._thread.is_alive():  # a consumer is closed by the thread that polls it, or not
            self._consumer.close()
