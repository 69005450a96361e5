"""Sends the trainer's events from a background thread; training never waits.

Step events go into a bounded queue: when the bus is slow or away, the oldest
are dropped (and counted) rather than the trainer blocked. Acks and
checkpoint events are rarer and matter more, so they have their own queue
that is sent first and dropped from only if it, too, overflows.

The training thread hands over plain field dicts; building and encoding the
pydantic model happens on the sender thread (tens of microseconds a step
that the training loop does not pay). With a signing key, step events, the
run's start and end, checkpoint events and acks are signed there too: the
workers take only those signed with the run's key, so nobody else can make
the pipeline act on this run, choose its rollback target, or disarm it.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import deque
from typing import Any

from pydantic import BaseModel, SecretStr

from spikeguard.bus import Producer
from spikeguard.metrics import Metrics, default_metrics
from spikeguard.schemas import StepEvent, encode
from spikeguard.schemas.signing import SIGNED_TYPES, sign

log = logging.getLogger(__name__)

Item = tuple[str, "type[BaseModel] | None", Any]  # topic, model to build (None: already built), fields/event


class BackgroundPublisher:
    """A bounded, drop-oldest, background sender of events keyed by ``run_id``."""

    def __init__(self, producer: Producer, key: str, queue_size: int = 10_000,
                 interval: float = 0.02, threaded: bool = True,
                 metrics: Metrics | None = None, signing_key: SecretStr | None = None) -> None:
        self.producer = producer
        self.signing_key = signing_key
        # Also counted where Prometheus sees it: a trainer losing events must show.
        self._dropped_total = (metrics or default_metrics()).trainer_dropped
        self.key = key
        self.queue_size = queue_size
        self.interval = interval
        self.dropped = 0  # events thrown away because the queue was full
        self.failed = 0  # events the bus refused (logged)
        self.sent = 0
        self._steps: deque[Item] = deque()
        self._control: deque[Item] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._idle = threading.Event()
        self._idle.set()
        self._pass_event = "event" in inspect.signature(producer.publish).parameters
        # A pipeline in a child process takes step fields as queued (bus/embedded_process.py):
        # building, signing and encoding them then happen there, off this process's GIL.
        self._ship = getattr(producer, "ship_fields", None)
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name=f"spikeguard-publisher-{key}",
                                            daemon=True)
            self._thread.start()

    # -- training thread ------------------------------------------------------
    def submit(self, topic: str, model: type[BaseModel] | None, fields: Any, *,
               droppable: bool = True) -> None:
        """Queue one event (``model(**fields)``, or ``fields`` itself when model is None)."""
        queue = self._steps if droppable else self._control
        with self._lock:
            if len(queue) >= self.queue_size:
                queue.popleft()
                self.dropped += 1
                self._dropped_total.inc()
            queue.append((topic, model, fields))
            self._idle.clear()
        if self._thread is None:
            self._drain()
        elif not droppable:
            self._wake.set()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far went out; False on timeout."""
        if self._thread is None:
            self._drain()
            return True
        self._wake.set()
        return self._idle.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        pending = len(self._steps) + len(self._control)
        if pending:
            self.dropped += pending
            self._dropped_total.inc(pending)
            log.warning("spikeguard publisher closed with %d unsent events", pending)

    # -- sender thread --------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self.interval)
            self._wake.clear()
            self._drain()

    def _next(self) -> Item | None:
        with self._lock:
            if self._control:
                return self._control.popleft()
            if self._steps:
                return self._steps.popleft()
            return None

    def _steps_after(self, topic: str) -> list[Any]:
        """The field dicts of the step events queued right behind the one just taken."""
        batch = []
        with self._lock:
            steps = self._steps
            while steps and steps[0][0] == topic and steps[0][1] is StepEvent:
                batch.append(steps.popleft()[2])
        return batch

    def _drain(self) -> None:
        while True:
            item = self._next()
            if item is None:
                break
            topic, model, fields = item
            if model is StepEvent and self._ship is not None:
                batch = [fields] + self._steps_after(topic)
                if self._ship(topic, batch, self.signing_key):
                    self.sent += len(batch)
                    continue
                for fields in batch:  # nobody takes them as they are: build them here
                    self._publish(topic, model, fields)
                continue
            self._publish(topic, model, fields)
        try:
            self.producer.flush(timeout=5.0)
        except Exception as exc:  # noqa: BLE001
            self.failed += 1
            log.warning("spikeguard producer flush failed: %r", exc)
        with self._lock:
            if not self._steps and not self._control:
                self._idle.set()

    def _publish(self, topic: str, model: "type[BaseModel] | None", fields: Any) -> None:
        try:
            event = fields if model is None else model(**fields)
            if self.signing_key is not None and type(event) in SIGNED_TYPES:
                event = sign(event, self.signing_key)  # steps, run events, checkpoints, acks
            if self._pass_event:
                self.producer.publish(topic, encode(event), key=self.key, event=event)
            else:
                self.producer.publish(topic, encode(event), key=self.key)
            self.sent += 1
        except Exception as exc:  # noqa: BLE001 - the bus must never kill training
            self.failed += 1
            if self.failed <= 5 or self.failed % 1000 == 0:
                log.warning("spikeguard could not publish to %s (%d failures): %r",
                            topic, self.failed, exc)
