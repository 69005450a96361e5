"""The embedded pipeline in a child process, bridged to the trainer's in-process bus.

With worker threads in the trainer's process, the pipeline's Python work (about
a millisecond per step, most of it the ml detector) shares the trainer's GIL:
a tiny model trains at a fraction of its speed. Here the workers run in a
child process on a bus of their own, and the trainer's process does as little
per step as it can:

- the Guard's step events stay the field dicts the training thread queued:
  the publisher's thread sends each batch of them down the pipe as it is,
  and leaves them on the trainer's bus as :class:`PendingStep` records
  (built and signed there only if somebody in the trainer's process reads
  them), without waking anyone; building, validating, signing and encoding
  them happens in the child, off the trainer's GIL;
- two :class:`Forwarder` threads copy records between the buses: the
  trainer's other inputs to the pipeline (runs, checkpoints, acks, steps
  published by anyone else) go down,
  what the trainer and its user read (actions, decisions, dead letters) comes
  back, one message per batch. A forwarder keeps adding to a batch while
  records keep coming (up to ``max_linger_s``), so a fast run crosses in a
  few wake-ups a second; an action goes at once.

The child is a fresh interpreter (``python -m spikeguard.runtime.child``),
not a fork of a process that holds threads and torch (so it works where fork
is unavailable, and it does not re-import the user's script). Records cross
as pickled batches over two pipes; the settings (with the signing key) cross
once, over the pipe, never on a command line. The child stops when the
trainer closes the runtime or when its input pipe closes (the trainer died).
If the child dies first, the trainer logs it once with its exit code and
trains on with the Guard's local protections (:attr:`ChildPipeline.problem`).

With ``data_dir`` only the child records (its bus sees every topic of the
pipeline); the trainer's bus stays in memory. The child's Prometheus series
cross on request (:meth:`ChildPipeline.metrics`), so the trainer's process
serves them with its own on one port (:mod:`spikeguard.bus.embedded_metrics`).
"""

from __future__ import annotations

import contextlib
import gc
import hmac
import json
import logging
import os
import subprocess
import sys
import threading
import time
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, Callable

from spikeguard.bus.base import Record
from spikeguard.bus.embedded import EmbeddedBus
from spikeguard.errors import BusError
from spikeguard.runtime.base import Runtime, embedded_bus
from spikeguard.runtime.threads import start_workers
from spikeguard.schemas import StepEvent, Topics, encode, sign_step

log = logging.getLogger(__name__)

BRIDGE_GROUP = "bridge"
READY = "ready"
STARTUP_TIMEOUT_S = 120.0
RECORDS = "records"
#: Down: a request for the child's metric families; up: the families (a list of prometheus Metric).
METRICS = "metrics"
#: Only the pipeline's own series cross: the child's process_* and python_* describe the child.
METRIC_PREFIX = "spikeguard_"


def inputs_of(topics: Topics) -> list[str]:
    """What the trainer publishes and the pipeline reads."""
    return [topics.steps, topics.runs, topics.checkpoints, topics.acks]


def outputs_of(topics: Topics) -> list[str]:
    """What the pipeline publishes and the trainer (or its user) reads."""
    return [topics.actions, topics.decisions, topics.dlq]


def _wire(record: Record) -> tuple:
    """``(topic, key, value, headers, fields)`` as it crosses; ``fields`` only for a trainer's step."""
    return (record.topic, record.key, record.value, tuple(record.headers or ()), None)


class PendingStep(Record):
    """A trainer's step on the trainer's bus, kept as the fields it was queued with.

    The child builds and signs it; here it is built (and signed with the same
    key: the same bytes, HMAC is deterministic) only when somebody reads it.
    Fields that make no valid step read as their JSON, which no decoder takes.
    """

    __slots__ = ("fields", "signing_key")

    def __init__(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None,
        value: bytes | None,
        headers: tuple = (),
        timestamp_ms: int = 0,
        cache: dict | None = None,
        event: Any = None,
        *,
        signing_key: Any = None,
    ) -> None:
        # Its cache is made here, so never None below (Record's may be, until first use).
        super().__init__(topic, partition, offset, key, None, headers, timestamp_ms, cache={})
        self.fields = event
        self.signing_key = signing_key

    def _step(self) -> StepEvent | None:
        found = self._cache.get(StepEvent)  # type: ignore[union-attr]  # made in __init__
        if found is None and self._value is None:
            try:
                found = sign_step(StepEvent(**self.fields), self.signing_key)
            except (ValueError, TypeError):  # pydantic's ValidationError is a ValueError
                self._value = json.dumps(self.fields, default=str).encode()
                return None
            self._cache[StepEvent] = found  # type: ignore[index]  # made in __init__
            self._value = encode(found)
        return found

    @property
    def value(self) -> bytes | None:
        self._step()
        return self._value

    @property
    def cache(self) -> dict:
        self._step()
        return self._cache  # type: ignore[return-value]  # made in __init__

    @cache.setter
    def cache(self, cache: dict) -> None:
        self._cache = cache

    def cached(self, model: type) -> Any:
        return self._step() if model is StepEvent else None


class Link:
    """One end of a pipe that several threads write to (a forwarder and the publisher)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, message: Any) -> None:
        with self._lock:
            self.conn.send(message)


class Forwarder:
    """Copies the records of ``topics`` from ``bus`` to ``link``, one message per batch.

    Woken by a record, it waits ``linger_s`` at a time for more while more keep
    coming, up to ``max_linger_s``: one send (and one wake-up of the other
    side) per burst, not per record. A record of an ``urgent`` topic goes at once.
    """

    def __init__(
        self,
        bus: EmbeddedBus,
        topics: list[str],
        group: str,
        link: Link,
        linger_s: float,
        max_linger_s: float = 0.0,
        urgent: tuple[str, ...] = (),
        poll_timeout_s: float = 0.5,
    ) -> None:
        self.link = link
        self.linger_s = linger_s
        self.max_linger_s = max(linger_s, max_linger_s)
        self.urgent = frozenset(urgent)
        self.poll_timeout_s = poll_timeout_s
        self._stop = threading.Event()
        self._consumer = bus.consumer(group, topics)  # subscribed now: nothing published is missed
        self.thread = threading.Thread(target=self._run, name=f"spikeguard-{group}", daemon=True)

    def start(self) -> "Forwarder":
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.forward_once(self.poll_timeout_s)
            self.forward_once(0)  # what came in before the stop
        except (BrokenPipeError, EOFError, OSError) as exc:
            log.warning("spikeguard: the embedded pipeline's bridge closed: %s", exc)
        finally:
            self._consumer.close()

    def _is_urgent(self, records: list[Record]) -> bool:
        return bool(self.urgent) and any(r.topic in self.urgent for r in records)

    def forward_once(self, timeout: float) -> int:
        records = self._consumer.poll(10_000, timeout)
        # Only the trainer's own steps (they went down when published): nothing to linger for.
        gone = all(type(r) is PendingStep for r in records)
        if records and self.linger_s > 0 and not gone and not self._is_urgent(records):
            deadline = time.monotonic() + self.max_linger_s
            pause = self.linger_s
            # A lone record (lockstep) goes after one pause; a stream is looked at ever less
            # often (each look is a poll and a GIL hand-off) until the batch is old enough.
            while not self._stop.wait(min(pause, max(0.0, deadline - time.monotonic()))):
                more = self._consumer.poll(10_000, 0)
                records += more
                if not more or self._is_urgent(more) or time.monotonic() >= deadline:
                    break
                pause *= 2
        if records:
            # A pending step went down when it was published (ChildPipeline.ship_fields).
            wired = [_wire(r) for r in records if type(r) is not PendingStep]
            if wired:
                self.link.send((RECORDS, wired))
            self._consumer.commit()
        return len(records)

    def stop(self) -> None:
        self._stop.set()
        self._consumer.wakeup()  # (records wake its poll; this ends it for the stop)
        self.thread.join(timeout=10)


def receive(
    bus: EmbeddedBus,
    conn: Connection,
    signing_key: Any = None,
    dlq: str = "",
    on_metrics: Callable[[Any], None] | None = None,
) -> None:
    """Publish the batches that come in on ``conn`` into ``bus`` until ``None`` or the pipe closes.

    Step fields (only the child gets them) are built and signed here with the
    pipeline's key; fields that do not make a valid step go to the DLQ. A
    ``METRICS`` message goes to ``on_metrics`` (a request in the child, the
    answer in the trainer's process).
    """
    producer = bus.producer()
    try:
        while True:
            message = conn.recv()
            if message is None:
                return
            if message[0] == METRICS:
                if on_metrics is not None:
                    on_metrics(message[1])
                continue
            producer.publish_records(
                [
                    (topic, key, value, headers, None)
                    if fields is None
                    else _built(topic, key, fields, signing_key, dlq)
                    for topic, key, value, headers, fields in message[1]
                ]
            )
            producer.flush()
    except (EOFError, OSError):
        return
    finally:
        producer.close()


def _built(topic: str, key: bytes | None, fields: dict, signing_key: Any, dlq: str) -> tuple:
    """The record of a step built from its fields, or of its dead letter."""
    from pydantic import ValidationError

    from spikeguard.schemas import DeadLetter

    try:
        event = StepEvent(**fields)
    except (ValidationError, TypeError) as exc:
        log.warning("spikeguard: a trainer's step could not be built: %s", exc)
        text = json.dumps(fields, default=str)
        letter = DeadLetter(
            source_topic=topic,
            partition=-1,
            offset=-1,
            key=str(fields.get("run_id")),
            value=text[:10_000],
            value_bytes=len(text),
            error=type(exc).__name__,
            reason=str(exc),
            consumer="spikeguard.bridge",
        )
        return (dlq, key, encode(letter), (), None)
    return (
        topic,
        key,
        None,
        (),
        sign_step(event, signing_key) if signing_key is not None else event,
    )


class ChildPipeline:
    """The trainer's side: the child process, one forwarder down, one receiver thread up."""

    def __init__(self, runtime: Runtime) -> None:
        bus, topics, settings = runtime.bus, runtime.topics, runtime.settings
        if not isinstance(bus, EmbeddedBus):
            raise TypeError(f"a child pipeline bridges an embedded bus, not {type(bus).__name__}")
        self.topics = topics
        self.signing_key = settings.keys()
        self._own_key_seen: Any = None  # a key object found equal to signing_key
        #: Why the pipeline is gone (the child died), or None while it runs.
        self.problem: str | None = None
        self._lost_lock = threading.Lock()
        self._closing = False
        # The child's newest metric families and the wait for an answer (see metrics()).
        self._families: list = []
        self._answered = threading.Condition()
        self._answers = 0
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        self.started = time.perf_counter()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "spikeguard.runtime.child", str(down_r), str(up_w)],
                pass_fds=(down_r, up_w),
                close_fds=True,
            )
        except (OSError, ValueError) as exc:  # no interpreter to start, or no fd passing here
            for fd in (down_r, down_w, up_r, up_w):
                os.close(fd)
            raise BusError(f"the embedded pipeline process could not be started: {exc}") from exc
        os.close(down_r)
        os.close(up_w)
        self._down = Link(Connection(down_w, readable=False))
        self._up = Connection(up_r, writable=False)
        try:
            self._down.send(settings)  # the key crosses the pipe, never argv or the environment
            # Steps published before the child's workers run would only queue up: wait for them.
            ready = self._up.poll(STARTUP_TIMEOUT_S) and self._up.recv() == READY
        except (OSError, EOFError):  # it exited before it was ready
            ready = False
        if not ready:
            self.process.kill()
            code = self.process.wait()
            self._down.conn.close()
            self._up.close()
            raise BusError(
                f"the embedded pipeline process did not start within {STARTUP_TIMEOUT_S:.0f}s "
                f"(exit code {code}; see its stderr)"
            )
        #: Seconds from launch to the child's workers running (imports, mostly).
        self.startup_s = time.perf_counter() - self.started
        worker = settings.worker
        group = f"{topics.prefix}{BRIDGE_GROUP}"
        self.forwarder = Forwarder(
            bus,
            inputs_of(topics),
            group,
            self._down,
            worker.embedded_batch_linger_s,
            worker.embedded_bridge_max_linger_s,
        ).start()
        self.receiver = threading.Thread(
            target=self._receive, args=(bus,), name="spikeguard-bridge-up", daemon=True
        )
        self.receiver.start()
        self._bus = bus
        bus.pipeline_link = self  # the publisher's way down

    def ship_fields(self, topic: str, batch: list[dict], signing_key: Any) -> bool:
        """Take these step fields as they are (:class:`PendingStep`); False if this pipeline cannot.

        Only for its own steps topic, and only when they would be signed with its
        own key (the child signs them): a Guard with another key publishes as
        before, and its steps are judged (refused) as before. Once the child is
        gone the publisher builds its steps itself again, for whoever reads them.
        """
        if (
            self.problem is not None
            or self._closing
            or topic != self.topics.steps
            or not self._is_own_key(signing_key)
        ):
            return False
        items = [(topic, _run_key(fields), None, (), fields) for fields in batch]
        # For readers in this process; the forwarder only commits past them.
        self._bus._append(items, partial(PendingStep, signing_key=self.signing_key), wake=False)
        try:
            self._down.send((RECORDS, items))
        except (OSError, ValueError) as exc:  # the child is gone: the next batch is built here
            self._lost(f"the bridge closed: {exc}", wait_s=1.0)  # the trainer's thread: brief
        return True

    def _is_own_key(self, signing_key: Any) -> bool:
        if signing_key is not None and signing_key is self._own_key_seen:
            return True  # (one Guard asks with the same key object every batch)
        if _same_key(signing_key, self.signing_key):
            self._own_key_seen = signing_key
            return True
        return False

    def _receive(self, bus: EmbeddedBus) -> None:
        receive(bus, self._up, on_metrics=self._metrics_arrived)
        if not self._closing:
            self._lost("its pipe closed")

    def _metrics_arrived(self, families: list) -> None:
        with self._answered:
            self._families = families
            self._answers += 1
            self._answered.notify_all()

    def metrics(self, timeout_s: float = 2.0) -> list:
        """The child's ``spikeguard_*`` metric families, asked for now.

        A scrape waits at most ``timeout_s`` for the answer; a child that is gone
        or busy past that leaves the newest families it sent (after :meth:`close`,
        those it had when its workers stopped).
        """
        with self._answered:
            asked = self._answers
            if self.problem is None and not self._closing:
                try:
                    self._down.send((METRICS, None))
                except (OSError, ValueError):
                    return self._families
                self._answered.wait_for(lambda: self._answers > asked, timeout_s)
            return self._families

    def _lost(self, why: str, wait_s: float = 5.0) -> None:
        with self._lost_lock:  # both threads may notice: report once
            if self.problem is not None or self._closing:
                return
            self._report_lost(why, wait_s)

    def _report_lost(self, why: str, wait_s: float) -> None:
        # Whichever side noticed first (the publisher's send or the receiver's
        # read), the exit code is what tells a user why: a kill, a crash, an OOM.
        try:
            code = self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            why = f"it exited with code {code} ({why})"
        self.problem = f"the embedded pipeline process stopped: {why}"
        log.error(
            "spikeguard: %s; training goes on with the Guard's local protections only "
            "(non-finite and outlier skips): no rollbacks or other actions until restarted",
            self.problem,
        )

    def close(self, timeout_s: float = 30.0) -> None:
        """Hand the child what the trainer published, let its workers save and stop, then wait."""
        self.forwarder.stop()
        self._closing = True
        with contextlib.suppress(OSError):
            self._down.send(None)
        self.receiver.join(timeout=timeout_s)  # the child closes its end once its workers stopped
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("spikeguard: the embedded pipeline process did not stop; killing it")
            self.process.kill()
            self.process.wait()
        self._down.conn.close()
        self._up.close()


def _run_key(fields: dict) -> bytes | None:
    run_id = fields.get("run_id")
    return run_id.encode() if isinstance(run_id, str) else None


def _same_key(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return False
    from spikeguard.schemas.signing import Keyring, _key_bytes

    if isinstance(a, Keyring) or isinstance(b, Keyring):
        return a == b
    return hmac.compare_digest(_key_bytes(a), _key_bytes(b))


def child_main(down_fd: int, up_fd: int) -> int:
    """The child: a bus, the pipeline's workers on it, and the two bridge ends."""
    down = Connection(down_fd, writable=False)
    up = Link(Connection(up_fd, readable=False))
    settings = down.recv()
    if settings.worker.embedded_process_nice and hasattr(
        os, "nice"
    ):  # the trainer first on busy cores
        os.nice(settings.worker.embedded_process_nice)
    bus = embedded_bus(settings)
    topics = Topics(settings.topic_prefix)
    bus.create_topics(topics.compacted(), compacted=True)
    bus.create_topics(topics.all())
    runtime = Runtime(bus, topics, settings)
    worker = settings.worker
    forwarder = Forwarder(
        bus,
        outputs_of(topics),
        f"{topics.prefix}{BRIDGE_GROUP}",
        up,
        worker.embedded_batch_linger_s,
        worker.embedded_bridge_max_linger_s,
        urgent=(topics.actions,),
    )
    # The pipeline's workers allocate many short-lived objects per record, and this process
    # holds nothing of the user's: as `spikeguard worker` does, fewer young-GC passes, with the
    # start-up heap frozen out of them.
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)
    start_workers(runtime)
    from spikeguard.runtime.monitoring import (
        start_monitoring,
    )  # alerts live here; /metrics in the trainer
    from spikeguard.metrics import default_metrics

    start_monitoring(runtime, serve_http=False)
    up.send(READY)  # before the forwarder's first batch can use the pipe
    forwarder.start()
    registry = (
        default_metrics().registry
    )  # what the workers count into (they get no Metrics of their own)
    if (
        settings.metrics_port is not None
    ):  # served by the trainer's process: the lag of these groups too
        from spikeguard.metrics_http import LagCollector

        registry.register(LagCollector.for_bus(bus, topics.prefix))

    def answer(_request: Any) -> None:
        up.send((METRICS, [m for m in registry.collect() if m.name.startswith(METRIC_PREFIX)]))

    receive(bus, down, settings.keys(), topics.dlq, on_metrics=answer)  # until the trainer closes
    runtime.close()  # the workers stop (and save) as the threads of an embedded runtime do
    forwarder.stop()
    with contextlib.suppress(OSError):  # the trainer may be gone
        answer(None)  # the final counts, for a trainer that reads them after closing
    up.conn.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(child_main(int(sys.argv[1]), int(sys.argv[2])))
