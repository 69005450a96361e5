"""Lockstep mode: wait until the pipeline has decided the step just taken.

Only for reproducible demos and tests — it blocks training, which a real run
must never do. After publishing step s the guard waits for the Decision of
(epoch, s), then for the actuator's pulse of it (the run's start says lockstep,
so the actuator pulses every decision after the actions it caused): every action
lands at the step it is due, on every run, however slowly the pipeline answers.

The decision awaited is fusion's own: with a key that checks decisions, an unsigned
or wrongly signed one is passed over, so a record written by anyone else can neither
answer the wait before the real decision nor hold the run for a settle time.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque

from spikeguard.bus import Bus
from spikeguard.errors import SchemaError
from spikeguard.schemas import Decision, Topics
from spikeguard.schemas.signing import Keyring, Signer

log = logging.getLogger(__name__)

#: Healthy decisions this many steps after an anomalous one are followed too: a spike's
#: rollback is decided once its patience (policy spike_patience_steps) ran out.
AFTER_ANOMALY_STEPS = 8


def _checks_decisions(signer: Signer | None) -> bool:
    """Whether ``signer`` holds a key that decisions are signed with (a shared key, or the
    keyring's key for the role that produces decisions)."""
    key = signer.key if signer is not None else None
    if isinstance(key, Keyring):
        return key.key_for(Decision) is not None
    return key is not None


class DecisionWaiter:
    def __init__(
        self,
        bus: Bus,
        topics: Topics,
        run_id: str,
        timeout: float = 10.0,
        signer: Signer | None = None,
    ) -> None:
        self.run_id = run_id
        self.timeout = timeout
        # Without fusion's key there is nothing to check a decision with: every one is taken.
        self._signer = signer if _checks_decisions(signer) else None
        bus.create_topics([topics.decisions])
        self._consumer = bus.consumer(
            f"spikeguard-lockstep.{run_id}.{uuid.uuid4().hex[:8]}",
            [topics.decisions],
            from_beginning=True,
        )
        self._seen: dict[tuple[int, int], Decision] = {}
        self._order: deque[tuple[int, int]] = deque()
        self.timeouts = 0
        self._silent = False  # a wait timed out and no decision came since: do not wait again
        self.pulsed = True  # the actuator pulses each decision (until a wait for one times out)
        self._last_anomaly: tuple[int, int] = (
            -1,
            -1,
        )  # (epoch, step) of the newest anomalous decision

    def wait(self, epoch: int, step: int) -> Decision | None:
        """The decision of (epoch, step), or None after ``timeout`` seconds."""
        # Once a wait timed out, no pipeline answers: look without waiting until one does,
        # so that a lockstep run without workers trains on instead of stalling every step.
        deadline = time.monotonic() + (0.0 if self._silent else self.timeout)
        key = (epoch, step)
        while key not in self._seen:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and self._silent:
                self._poll(0.0)
                return self._seen.get(key)
            if remaining <= 0:
                self.timeouts += 1
                self._silent = True
                log.warning(
                    "spikeguard lockstep: no decision for step %d within %gs: no pipeline "
                    "answers; training goes on without waiting until one does",
                    step,
                    self.timeout,
                )
                return None
            self._poll(min(remaining, 0.5))
        return self._seen[key]

    def _poll(self, timeout: float) -> None:
        for record in self._consumer.poll(max_records=500, timeout=timeout):
            try:
                decision = record.decoded(Decision)
            except SchemaError:
                continue
            if decision.run_id != self.run_id:
                continue
            if self._signer is not None and self._signer.problem(decision) is not None:
                continue  # not fusion's: someone else wrote the decisions topic
            self._remember((decision.epoch, decision.step), decision)
            self._silent = False

    def follow(self, inbox, epoch: int, step: int, settle: float) -> None:
        """Wait for (epoch, step)'s decision, then for the actuator's pulse of it.

        The actuator pulses every decision of a lockstep run after the actions that decision
        caused, on the same partition: when the pulse is read, those actions are in the inbox,
        however long the pipeline took. An actuator that does not pulse each decision (one that
        predates lockstep pulses) gets the old bounded wait instead: ``settle`` seconds for the
        actions of an anomalous decision, and of the healthy ones a few steps after it."""
        decision = self.wait(epoch, step)
        if decision is None:
            return
        watch = getattr(inbox, "protection", None)
        if self.pulsed and watch is not None:
            if self._await_pulse(inbox, watch, (epoch, step)):
                return
            self.pulsed = False
            log.warning(
                "spikeguard lockstep: no pulse for step %d within %gs: the actuator does not "
                "pulse each decision of a lockstep run; actions are awaited %gs after an "
                "anomaly from now on, so one that comes later lands at a later step",
                step,
                self.timeout,
                settle,
            )
        self._settle(inbox, decision, epoch, step, settle)

    def _await_pulse(self, inbox, watch, key: tuple[int, int]) -> bool:
        """True once a pulse covers ``key`` (polling the inbox); False after ``timeout`` seconds."""
        deadline = time.monotonic() + self.timeout
        while watch.judged is None or watch.judged < key:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            inbox.poll_now(min(remaining, 0.5))
        return True

    def _settle(self, inbox, decision: Decision, epoch: int, step: int, settle: float) -> None:
        if decision.is_anomaly or decision.preventive:
            self._last_anomaly = (epoch, step)
        elif not (
            self._last_anomaly[0] == epoch
            and 0 < step - self._last_anomaly[1] <= AFTER_ANOMALY_STEPS
        ):
            return
        deadline = time.monotonic() + settle  # the actions derived from it follow within moments
        while time.monotonic() < deadline:
            inbox.poll_now(0.005)
            if any(a.decision_id == decision.decision_id for a in list(inbox._ready)):
                inbox.poll_now(0.005)  # and their siblings, published right after
                return

    def _remember(self, key: tuple[int, int], decision: Decision) -> None:
        self._seen[key] = decision
        self._order.append(key)
        while len(self._order) > 4096:
            self._seen.pop(self._order.popleft(), None)

    def close(self) -> None:
        self._consumer.close()
