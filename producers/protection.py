"""Is anyone judging this run? The actuator's signed pulses say so; silence is said once.

A trainer whose key differs from the workers', whose workers are not running,
whose steps all go to the DLQ or whose pipeline lags far behind trains on
with its local protections only, and would never know. So the actuator
answers the decisions it acts on with a signed ``pulse`` action now and then
(at most one per run every ``pulse_interval_s``, :mod:`spikeguard.actuators.actuator_stage`),
naming the newest (epoch, step) judged; the trainer's inbox hands pulses here,
never to the training thread.

A step this trainer published that no valid pulse has covered for
``timeout_s`` makes the run *unprotected* (the first step: ``first_timeout_s``,
a few seconds, so that a short run hears it before its first checkpoint): one
WARNING line naming the likely cause the trainer can see, the
``spikeguard_trainer_unprotected`` gauge at 1; training goes on. A valid pulse
later says so in one line and sets the gauge back to 0. What it can see: pulses
with a bad signature (the trainer's key differs from the actuator's), sends the
broker refused (unreachable), and valid pulses of a newer trainer session of
the same run id: another trainer started with this run id, and the pipeline
now judges that one and refuses this one's records. That last one is said at
once, as an ERROR naming the clash.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from spikeguard.metrics import Metrics, default_metrics
from spikeguard.producers.refusals import RefusalWatch
from spikeguard.schemas import Action
from spikeguard.schemas.signing import Signer

log = logging.getLogger(__name__)

#: How many published (epoch, step) marks are waiting for a pulse at most; the oldest is what counts.
_MAX_MARKS = 4096


class ProtectionWatch:
    """Published steps waiting for a pulse, and whether they waited too long.

    ``published()`` returns the trainer's newest published (epoch, step) (step -1:
    none yet), read on every :meth:`check` (the inbox's thread, or the training
    thread in lockstep).
    """

    def __init__(
        self,
        run_id: str,
        signer: Signer,
        published: Callable[[], tuple[int, int]],
        timeout_s: float = 30.0,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        session: str | None = None,
        first_timeout_s: float = 5.0,
        send_failures: Callable[[], int] = lambda: 0,
        refusals: RefusalWatch | None = None,
    ) -> None:
        self.run_id = run_id
        self.signer = signer
        self.published = published
        self.timeout_s = timeout_s
        self.first_timeout_s = min(first_timeout_s, timeout_s)
        self.session = session
        self.send_failures = send_failures  # sends the broker refused so far
        self.refusals = refusals  # what the workers refused of this run (the DLQ), if read
        self.newer_session: str | None = None  # a newer session of this run id, judged instead
        self.clock = clock
        self._gauge = (metrics or default_metrics()).trainer_unprotected.labels(run_id)
        self._gauge.set(0)
        self._waiting: deque[tuple[tuple[int, int], float]] = deque()  # (epoch, step), since when
        self.judged: tuple[int, int] | None = None  # the newest (epoch, step) a valid pulse named
        self.pulses = 0
        self.bad_pulses = 0
        self.unprotected = False

    def pulse(self, action: Action) -> None:
        """A pulse action for this run: valid, it covers every published step up to the one it names."""
        if self.signer.problem(action) is not None:
            self.bad_pulses += 1
            return
        params = action.params
        judged = (params.epoch, params.judged_step)  # type: ignore[union-attr]
        self.pulses += 1
        if self.judged is None or judged > self.judged:
            self.judged = judged
        waiting = self._waiting
        while waiting and waiting[0][0] <= judged:
            waiting.popleft()
        if self.unprotected:
            self.unprotected = False
            self._gauge.set(0)
            log.warning(
                "spikeguard: run %s is judged by the pipeline again (pulse for step %d of epoch %d)",
                self.run_id,
                judged[1],
                judged[0],
            )

    def other_session(self, action: Action) -> None:
        """A pulse of another trainer session of this run id: a newer one is judged instead of
        this one (an ERROR, once); an older one's (an earlier run's, read back) says nothing."""
        if self.session is None or action.session is None or action.session <= self.session:
            return
        if self.signer.problem(action) is not None:
            self.bad_pulses += 1
            return
        if self.newer_session is not None:
            return
        self.newer_session = action.session
        self.unprotected = True
        self._gauge.set(1)
        log.error(
            "spikeguard: run id %s is in use by another trainer: a newer session (%s) of the same "
            "run id started after this one (%s), and the pipeline now judges that one and refuses "
            "this trainer's steps. This run is NOT protected by the pipeline; give each trainer "
            "its own run_id (GuardConfig run_id / SPIKEGUARD_RUN_ID). Training goes on with the "
            "local protections only",
            self.run_id,
            action.session,
            self.session,
        )

    def check(self) -> bool:
        """Note the trainer's newest step; True (and one WARNING the first time) when the run is unprotected."""
        now = self.clock()
        newest = self.published()
        waiting = self._waiting
        if waiting and newest < waiting[-1][0]:
            waiting.clear()  # resumed from an older step: the abandoned steps will never be judged
        if (
            newest[1] >= 0
            and (self.judged is None or newest > self.judged)
            and (not waiting or newest > waiting[-1][0])
            and len(waiting) < _MAX_MARKS
        ):
            waiting.append((newest, now))
        timeout = self.timeout_s if self.judged is not None else self.first_timeout_s
        if not waiting or now - waiting[0][1] < timeout or self.unprotected:
            return self.unprotected
        self.unprotected = True
        self._gauge.set(1)
        oldest = waiting[0][0]
        failed = self.send_failures()
        refused = self.refusals.counts if self.refusals is not None else {}
        own_refused = self.refusals.own_bad_signatures if self.refusals is not None else 0
        if own_refused:
            cause = (
                f"the workers refused {own_refused} of this trainer's steps with a bad signature "
                "(the DLQ says so): the trainer's signing key differs from the workers' "
                "(SPIKEGUARD_SIGNING_KEY)"
            )
        elif refused.get("RecordOfOtherSession"):
            cause = (
                "the workers refuse records of this run id as of another trainer session (the DLQ "
                "says so): run_id already in use by another trainer?"
            )
        elif self.bad_pulses:
            cause = (
                f"{self.bad_pulses} pulses from the pipeline failed their signature check: the trainer's "
                "signing key differs from the actuator's (SPIKEGUARD_SIGNING_KEY)"
            )
        elif failed:
            cause = (
                f"the broker is unreachable: {failed} of the trainer's sends failed "
                "(SPIKEGUARD_BOOTSTRAP_SERVERS, the broker's health)"
            )
        else:
            cause = (
                "likely causes: the trainer's signing key differs from the workers' (its steps then "
                "go to the DLQ), no workers run for this topic prefix (spikeguard worker ...), its "
                "steps are refused to the DLQ for another reason, or the pipeline lags this far behind"
            )
        log.warning(
            "spikeguard: run %s is NOT protected by the pipeline: step %d of epoch %d, published "
            "%.0f s ago, has not been judged (newest judged: %s); %s. Training goes on with the "
            "local protections only (non-finite and outlier skips)",
            self.run_id,
            oldest[1],
            oldest[0],
            now - waiting[0][1],
            "none" if self.judged is None else f"step {self.judged[1]} of epoch {self.judged[0]}",
            cause,
        )
        return True
