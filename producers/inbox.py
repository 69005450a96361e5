"""Receives this run's actions from the bus, off the training thread.

A background thread polls the actions topic (a consumer group of this run,
rank and trainer session alone) and hands this run's actions to the training
thread through a deque; the training thread only ever looks at that deque.
The group is the session's because two trainers of one run id (a clash, or a
restart while the old process still runs) must each read the run's actions
partition: in one group the partition would be one member's, and the other
would never read the pulses that tell it of the clash. A new session so reads
the partition from its start and leaves the earlier sessions' actions alone
(counted; the first said at INFO). Offsets are committed only when every
action handed over has been resolved (applied, refused or found a duplicate,
and the ledger persisted), so a consumer that rejoins its group re-reads
rather than loses, and the ledger makes re-reading harmless; the commits also
let the embedded bus drop what the session has read.

The actuator's pulses (``pulse`` actions: "the pipeline judged this run up to
step s") go to the run's :class:`~spikeguard.producers.protection.ProtectionWatch`
instead, which the inbox asks after every poll whether the run is still judged.

An action names the trainer session whose steps it answers. One of another
session (an earlier run of this run id, whose actions a deterministic re-run
would find with the very same ids and signatures, replayed) is not this
trainer's: it never reaches the training thread and gets no ack (an ack would
speak for this session's plan). A later session's is another trainer with this
run id: the first is a WARNING.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

from spikeguard.bus import Bus
from spikeguard.deadletters import dead_letter
from spikeguard.errors import SchemaError
from spikeguard.producers.protection import ProtectionWatch
from spikeguard.producers.refusals import RefusalWatch
from spikeguard.schemas import Action, ActionKind, Topics, encode

log = logging.getLogger(__name__)


def group_name(run_id: str, rank: int, session: str | None) -> str:
    return f"spikeguard-guard.{run_id}.r{rank}" + (f".{session}" if session else "")


class ActionInbox:
    def __init__(
        self,
        bus: Bus,
        topics: Topics,
        run_id: str,
        rank: int = 0,
        threaded: bool = True,
        poll_timeout: float | None = None,
        protection: ProtectionWatch | None = None,
        session: str | None = None,
        refusals: RefusalWatch | None = None,
    ) -> None:
        self.run_id = run_id
        self.session = session  # this trainer's (None: take actions of any session)
        self.other_session = 0  # actions of another session left alone
        self._older_session = 0  # of those, of an earlier session (logged once, at INFO)
        self._newer_session = 0  # of a later one (logged once, a WARNING)
        self.refusals = refusals  # this run's dead letters, read by their own thread
        self.protection = protection  # None: nobody asks whether the run is judged
        self.topic = topics.actions
        self.dlq_topic = topics.dlq
        bus.create_topics([self.topic, self.dlq_topic])
        self.group = group_name(run_id, rank, session)
        self._consumer = bus.consumer(self.group, [self.topic], from_beginning=True)
        # An action wakes the poll as it arrives; the timeout only paces the protection check and
        # the stop. A consumer that can be woken to stop lets the thread sleep long (each wake-up
        # of it costs the training thread a GIL hand-off).
        self._wakeup = getattr(self._consumer, "wakeup", None)
        self.poll_timeout = (
            poll_timeout if poll_timeout is not None else 0.5 if self._wakeup else 0.05
        )
        self._producer = bus.producer()  # for dead letters only
        self._ready: deque[Action] = deque()
        self._lock = threading.Lock()  # the consumer is used by one thread at a time
        # Each counter is written by one thread only, so the training thread never waits on a lock.
        self._handed = 0  # actions handed to the training thread (inbox thread)
        self._resolved = 0  # of those, resolved for good (training thread)
        self._uncommitted = False
        self.malformed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(
                target=self._run, name=f"spikeguard-inbox-{run_id}", daemon=True
            )
            self._thread.start()

    # -- training thread ------------------------------------------------------
    def take(self) -> list[Action]:
        """Every action received since the last call (they now count as outstanding)."""
        out = []
        while self._ready:
            out.append(self._ready.popleft())
        return out

    def poll_now(self, timeout: float = 0.0) -> None:
        """Poll in the calling thread (lockstep mode, where no inbox thread runs)."""
        self._poll(timeout)

    def resolved(self, count: int = 1) -> None:
        """``count`` actions are done for good (their result is in the ledger)."""
        self._resolved += count
        if self._thread is None:
            self._maybe_commit()
        elif self._wakeup is not None:
            # The thread sleeps in a long poll: wake it to commit now, so a trainer killed soon
            # after applying an action does not read it again on restart (rare: actions are).
            self._wakeup()

    def close(self) -> None:
        self._stop.set()
        if self._wakeup is not None:
            self._wakeup()
        if self._thread is not None:
            self._thread.join(2.0)
        with self._lock:
            self._maybe_commit()
            self._consumer.close()
            if self.refusals is not None:
                self.refusals.close()
        self._producer.close()

    # -- inbox thread ---------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll(self.poll_timeout)
            except Exception as exc:  # noqa: BLE001 - a bus hiccup must not kill the guard
                log.warning("spikeguard action inbox: poll failed: %r", exc)
                self._stop.wait(1.0)

    def _poll(self, timeout: float) -> None:
        with self._lock:
            records = self._consumer.poll(max_records=500, timeout=timeout)
            for record in records:
                if record.key_text not in (None, self.run_id):
                    continue
                try:
                    action = record.decoded(Action)
                except SchemaError as exc:
                    self.malformed += 1
                    log.warning(
                        "spikeguard: undecodable action at %s[%d]@%d: %s",
                        record.topic,
                        record.partition,
                        record.offset,
                        exc,
                    )
                    self._dead_letter(record, exc)
                    continue
                if action.run_id != self.run_id:
                    continue
                if self._other_session(action):
                    continue
                if (
                    action.kind is ActionKind.PULSE
                ):  # about the pipeline, not for the training thread
                    if self.protection is not None:
                        self.protection.pulse(action)
                    continue
                self._handed += 1
                self._ready.append(action)
            if records:
                self._uncommitted = True
            self._maybe_commit()
        if self.protection is not None:
            self.protection.check()

    def _other_session(self, action: Action) -> bool:
        """True when ``action`` answers another trainer session of this run id (left alone)."""
        if action.session is None or self.session is None or action.session == self.session:
            return False
        if action.kind is ActionKind.PULSE:  # another trainer is being judged under this run id
            if self.protection is not None:
                self.protection.other_session(action)
            return True
        self.other_session += 1
        if action.session < self.session:
            # An earlier run of this run id, read back from the partition's start (every restart
            # of a run that acted does so), or replayed: nothing for this trainer, nothing wrong.
            self._older_session += 1
            if self._older_session == 1:
                log.info(
                    "spikeguard: run %s: leaving alone the actions of earlier sessions of this run "
                    "id (first: %s %s of session %s); they are counted, not logged",
                    self.run_id,
                    action.kind.value,
                    action.action_id,
                    action.session,
                )
            return True
        self._newer_session += 1
        if self._newer_session == 1:
            log.warning(
                "spikeguard: run %s: ignoring %s action %s of trainer session %s, not this one (%s): "
                "another trainer with the same run id, started after this one; further ones are "
                "counted, not logged",
                self.run_id,
                action.kind.value,
                action.action_id,
                action.session,
                self.session,
            )
        return True

    def _dead_letter(self, record, exc: Exception) -> None:
        try:
            self._producer.publish(
                self.dlq_topic, encode(dead_letter(record, exc, self.group)), key=record.key
            )
            self._producer.flush(5.0)
        except Exception as failure:  # noqa: BLE001 - training goes on; the log keeps it
            log.error("spikeguard: could not send a dead letter: %r", failure)

    def _maybe_commit(self) -> None:
        if self._uncommitted and self._resolved >= self._handed:
            try:
                self._consumer.commit()
                self._uncommitted = False
            except Exception as exc:  # noqa: BLE001
                log.warning("spikeguard action inbox: commit failed: %r", exc)
