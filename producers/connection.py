"""A Guard's links on its bus: what it publishes through and what it hears back on.

:func:`open_links` builds them: the background publisher, and on rank 0 the action
inbox, the watch on whether the pipeline judges the run, and in lockstep mode
the decision waiter. (Where the bus comes from: wiring.py.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from spikeguard.producers.config import GuardConfig
from spikeguard.producers.inbox import ActionInbox
from spikeguard.producers.lockstep import DecisionWaiter
from spikeguard.producers.protection import ProtectionWatch
from spikeguard.producers.publisher import BackgroundPublisher
from spikeguard.producers.refusals import RefusalWatch
from spikeguard.producers.run_state import RunState
from spikeguard.schemas import Topics
from spikeguard.schemas.signing import Signer

log = logging.getLogger("spikeguard.producers.guard")


@dataclass
class Connection:
    """A Guard's links on its bus (all None: no bus)."""

    publisher: BackgroundPublisher | None = None
    inbox: ActionInbox | None = None  # rank 0
    watch: ProtectionWatch | None = None  # how far the pipeline has judged (rank 0)
    waiter: DecisionWaiter | None = None  # lockstep (rank 0)

    def close(self, flush_timeout: float) -> None:
        """Stop listening, then send what is queued (for at most ``flush_timeout`` seconds)."""
        for part in (self.waiter, self.inbox):
            if part is not None:
                part.close()
        if self.publisher is not None:
            self.publisher.close(flush_timeout)


def open_links(
    bus: Any,
    topics: Topics,
    run: RunState,
    *,
    session: str,
    signer: Signer,
    config: GuardConfig,
    rank: int,
) -> Connection:
    """The Guard's links on ``bus`` (None: none)."""
    if bus is None:
        return Connection()
    t = topics
    bus.create_topics([t.steps, t.acks, t.checkpoints, t.actions, t.decisions])
    bus.create_topics([t.runs], compacted=True)
    publisher = BackgroundPublisher(
        bus.producer(),
        run.run_id,
        config.queue_size,
        threaded=not config.lockstep,
        signing_key=signer.key,
    )
    if rank != 0:
        return Connection(publisher)
    # Does the pipeline judge this run? Said once if not (producers/protection.py).
    refusals = RefusalWatch(bus, t, run.run_id, session)
    watch = ProtectionWatch(
        run.run_id,
        signer,
        session=session,
        send_failures=lambda: publisher.failed,
        refusals=refusals,
        timeout_s=config.unprotected_after_s,
        published=lambda: (run.generation, run.step_count - 1),
    )
    inbox = ActionInbox(
        bus,
        t,
        run.run_id,
        0,
        threaded=not config.lockstep,
        protection=watch,
        session=session,
        refusals=refusals,
    )
    waiter = None
    if config.lockstep:
        waiter = DecisionWaiter(bus, t, run.run_id, config.lockstep_timeout, signer)
    return Connection(publisher, inbox, watch, waiter)


def warn_unsigned(run_id: str) -> None:
    log.warning(
        "spikeguard: run %s was handed a bus without a signing key (GuardConfig."
        "signing_key): its steps go out unsigned, so a pipeline that checks signatures "
        "(every embedded runtime's, Kafka workers with a key) refuses them to the DLQ, and "
        "it obeys unsigned actions. Hand an embedded runtime as Guard(..., runtime="
        "runtime), or give the Guard the pipeline's key in GuardConfig(signing_key=...)",
        run_id,
    )
