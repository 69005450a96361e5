"""Sends the trainer's events from a background thread; training never waits.

Step events go into a bounded queue: when the bus is slow or away, the oldest
ordinary steps are dropped (and counted) rather than the trainer blocked. An
*urgent* step (non-finite, skipped, or an outlier by the Guard's own rule) is
what the pipeline exists for: it is never dropped while an ordinary step can
go instead, and it wakes the sender at once, so its decision is not held
back by batching. Ordinary steps go in batches, at most ``interval`` after
the first of them was queued; an idle sender sleeps until something comes.
Acks and checkpoint events are rarer and matter more, so they have their own
queue that is sent first and dropped from only if it, too, overflows.

The training thread hands over plain field dicts; building and encoding the
pydantic model happens on the sender thread (tens of microseconds a step
that the training loop does not pay). An ordinary step is handed over rawer
still (:meth:`BackgroundPublisher.submit_step`): the values as they are and
the function that makes its field dict, appended to a deque without the lock
(appends and pops of a deque are atomic); the sender thread makes the dict. With a signing key, step events, the
run's start and end, checkpoint events and acks are signed there too: the
workers take only those signed with the run's key, so nobody else can make
the pipeline act on this run, choose its rollback target, or disarm it.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections import deque
from typing import Any, Callable, NamedTuple, Protocol, cast

from pydantic import BaseModel

from spikeguard.bus import Producer
from spikeguard.metrics import Metrics, default_metrics
from spikeguard.schemas import StepEvent, encode
from spikeguard.schemas.signing import SIGNED_TYPES, SigningKey, sign

log = logging.getLogger(__name__)


class _TakesEvents(Protocol):
    """A producer whose ``publish`` also takes the event its bytes encode (the embedded bus's:
    in-process readers then need not decode it)."""

    def publish(
        self, topic: str, value: bytes, key: str | bytes | None = None, *, event: BaseModel
    ) -> None: ...


class Item(NamedTuple):
    """One queued event."""

    topic: str
    model: "type[BaseModel] | None"  # the model to build from ``fields`` (None: ``fields`` is the event)
    fields: Any
    urgent: bool = False  # a step the queue keeps while it can drop an ordinary one
    # makes the field dict from ``fields`` on the sender thread (None: ``fields`` is it)
    build: Callable[..., Any] | None = None


def _fields(item: Item) -> Any:
    return item.fields if item.build is None else item.build(*item.fields)


class BackgroundPublisher:
    """A bounded, drop-oldest, background sender of events keyed by ``run_id``."""

    def __init__(
        self,
        producer: Producer,
        key: str,
        queue_size: int = 10_000,
        interval: float = 0.02,
        threaded: bool = True,
        metrics: Metrics | None = None,
        signing_key: SigningKey | None = None,
    ) -> None:
        self.producer = producer
        self.signing_key = signing_key
        # Also counted where Prometheus sees it: a trainer losing events must show.
        self._dropped_total = (metrics or default_metrics()).trainer_dropped
        self.key = key
        self.queue_size = queue_size
        self.interval = interval  # the longest an ordinary step waits for its batch to go
        self.dropped = 0  # events thrown away because the queue was full
        self.failed = 0  # events the bus refused (logged)
        self.sent = 0
        self._steps: deque[Item] = deque()
        self._control: deque[Item] = deque()
        # Ordinary steps handed over without the lock (submit_step), older than any of _steps
        # queued after them: a locked submit moves them into _steps first.
        self._raw: deque[Item] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._idle = threading.Event()
        self._idle.set()
        self._parked = False  # the sender sleeps until woken: nothing was queued (under _lock)
        self._hurry = (
            False  # something queued must go now (an urgent step, a control event, a flush)
        )
        self._pass_event = "event" in inspect.signature(producer.publish).parameters
        # A pipeline in a child process takes step fields as queued (spikeguard/runtime/child.py):
        # building, signing and encoding them then happen there, off this process's GIL.
        self._ship = getattr(producer, "ship_fields", None)
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(
                target=self._run, name=f"spikeguard-publisher-{key}", daemon=True
            )
            self._thread.start()

    # -- training thread ------------------------------------------------------
    def submit(
        self,
        topic: str,
        model: type[BaseModel] | None,
        fields: Any,
        *,
        droppable: bool = True,
        urgent: bool = False,
    ) -> None:
        """Queue one event (``model(**fields)``, or ``fields`` itself when model is None).

        ``urgent``: a step that must reach the pipeline (kept over ordinary steps when the
        queue is full) and soon (the sender goes at once rather than after ``interval``).
        """
        self._locked_submit(Item(topic, model, fields, urgent), droppable)

    def submit_step(self, topic: str, build: Callable[..., Any], values: tuple[Any, ...]) -> None:
        """Queue one ordinary step event (droppable, not urgent): ``build(*values)`` makes its
        field dict, on the sender thread. No lock, no wake-up while the sender is awake."""
        raw = self._raw
        if len(raw) >= self.queue_size or self._thread is None:
            self._locked_submit(Item(topic, StepEvent, values, False, build), True)
            return
        raw.append(Item(topic, StepEvent, values, False, build))
        # The sender parks, then looks at _raw again (_run): an append it did not see finds it
        # parked here and wakes it.
        if self._parked or self._idle.is_set():
            self._locked_submit(None, True)

    def _locked_submit(self, item: Item | None, droppable: bool) -> None:
        queue = self._steps if droppable else self._control
        idle = self._idle
        urgent = item is not None and item.urgent
        with self._lock:
            raw = self._raw
            while raw:  # the steps handed over before this one go before it
                self._steps.append(raw.popleft())
            while len(queue) >= self.queue_size + (item is None):
                self._drop_one(queue)
            if item is not None:
                queue.append(item)
            # (set and cleared under this lock: clearing a clear Event would take its own lock)
            if idle.is_set():
                idle.clear()
            hurry = urgent or (item is not None and not droppable)
            wake = self._parked or hurry
            self._parked = False
            self._hurry = self._hurry or hurry
        if self._thread is None:
            self._drain()
        elif wake:
            self._wake.set()

    def _drop_one(self, queue: deque[Item]) -> None:
        """Make room (under the lock): the oldest ordinary event, else the oldest of all."""
        for i, item in enumerate(queue):
            if not item.urgent:
                del queue[i]
                break
        else:
            queue.popleft()  # every one urgent: the queue stays bounded all the same
        self.dropped += 1
        self._dropped_total.inc()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far went out; False on timeout."""
        if self._thread is None:
            self._drain()
            return True
        if self._raw:  # steps handed over without the lock: queued under it, idle cleared
            self._locked_submit(None, True)
        self._hurry = True
        self._wake.set()
        return self._idle.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self.flush(timeout)
        self._stop = True
        self._hurry = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        pending = len(self._steps) + len(self._control) + len(self._raw)
        if pending:
            self.dropped += pending
            self._dropped_total.inc(pending)
            log.warning("spikeguard publisher closed with %d unsent events", pending)

    # -- sender thread --------------------------------------------------------
    def _run(self) -> None:
        parked = False
        while not self._stop:
            # While steps flow, look every `interval` (the training thread never wakes this
            # thread then: a wake-up is a syscall it would pay per batch); after a round that
            # found nothing, sleep until a submit wakes us (an idle trainer costs nothing).
            self._wake.wait(None if parked else self.interval)
            self._wake.clear()
            if parked and not self._hurry and not self._stop:
                self._wake.wait(self.interval)  # woken by the first of a batch: the rest may come
                self._wake.clear()
            self._hurry = False
            sent = self._drain()
            with self._lock:
                parked = self._parked = not sent and not self._steps and not self._control
            if parked and self._raw:  # handed over before the trainer could see it parked
                self._parked = parked = False

    def _next(self) -> Item | None:
        with self._lock:
            if self._control:
                return self._control.popleft()
            if self._steps:
                return self._steps.popleft()
            if self._raw:
                return self._raw.popleft()
            return None

    def _steps_after(self, topic: str) -> list[Any]:
        """The field dicts of the step events queued right behind the one just taken."""
        batch = []
        with self._lock:
            for steps in (self._steps, self._raw):
                while steps and steps[0].topic == topic and steps[0].model is StepEvent:
                    batch.append(_fields(steps.popleft()))
                if steps:
                    break
        return batch

    def _drain(self) -> int:
        """Send everything queued; how many items went."""
        taken = 0
        while True:
            item = self._next()
            if item is None:
                break
            topic, model, fields = item.topic, item.model, _fields(item)
            taken += 1
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
            if not self._steps and not self._control and not self._raw:
                self._idle.set()
        return taken

    def _publish(self, topic: str, model: "type[BaseModel] | None", fields: Any) -> None:
        try:
            event = fields if model is None else model(**fields)
            if self.signing_key is not None and type(event) in SIGNED_TYPES:
                event = sign(event, self.signing_key)  # steps, run events, checkpoints, acks
            if self._pass_event:
                cast(_TakesEvents, self.producer).publish(
                    topic, encode(event), key=self.key, event=event
                )
            else:
                self.producer.publish(topic, encode(event), key=self.key)
            self.sent += 1
        except Exception as exc:  # noqa: BLE001 - the bus must never kill training
            self.failed += 1
            if self.failed <= 5 or self.failed % 1000 == 0:
                log.warning(
                    "spikeguard could not publish to %s (%d failures): %r", topic, self.failed, exc
                )
