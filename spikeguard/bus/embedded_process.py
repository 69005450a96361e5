"""The embedded pipeline in a child process, bridged to the trainer's in-process bus.

With worker threads in the trainer's process, the pipeline's Python work (about
a millisecond per step, most of it the ml detector) shares the trainer's GIL:
a tiny model trains at a fraction of its speed. Here the workers run in a
child process on a bus of their own, and two bridges copy records between the
buses: the trainer's inputs to the pipeline (steps, runs, checkpoints, acks)
go down, what the trainer and its user read (actions, decisions, dead letters)
comes back. The trainer's process keeps one thread that wakes once per batch.

The child is a fresh interpreter (``python -m spikeguard.bus.embedded_process``),
not a fork of a process that holds threads and torch, and it does not re-import
the user's script. Records cross as pickled ``(topic, key, value, headers)``
batches over two pipes; the settings (with the signing key) cross once, over
the pipe, never on a command line. The child stops when the trainer closes the
runtime or when its input pipe closes (the trainer died).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from spikeguard.bus.base import Bus, Record
from spikeguard.errors import BusError
from spikeguard.schemas import Topics

if TYPE_CHECKING:
    from spikeguard.runtime import Runtime

log = logging.getLogger(__name__)

BRIDGE_GROUP = "bridge"
READY = "ready"
STARTUP_TIMEOUT_S = 120.0


def inputs_of(topics: Topics) -> list[str]:
    """What the trainer publishes and the pipeline reads."""
    return [topics.steps, topics.runs, topics.checkpoints, topics.acks]


def outputs_of(topics: Topics) -> list[str]:
    """What the pipeline publishes and the trainer (or its user) reads."""
    return [topics.actions, topics.decisions, topics.dlq]


def _wire(record: Record) -> tuple:
    return (record.topic, record.key, record.value, tuple(record.headers or ()))


class Forwarder:
    """Copies the records of ``topics`` from ``bus`` to ``conn``, one message per batch."""

    def __init__(self, bus: Bus, topics: list[str], group: str, conn: Connection,
                 linger_s: float, poll_timeout_s: float = 0.05) -> None:
        self.conn = conn
        self.linger_s = linger_s
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

    def forward_once(self, timeout: float) -> int:
        records = self._consumer.poll(10_000, timeout)
        if records and self.linger_s > 0:
            self._stop.wait(self.linger_s)  # one message per batch, not per record
            records += self._consumer.poll(10_000, 0)
        if records:
            self.conn.send([_wire(r) for r in records])
            self._consumer.commit()
        return len(records)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)


def receive(bus: Bus, conn: Connection) -> None:
    """Publish the batches that come in on ``conn`` into ``bus`` until ``None`` or the pipe closes."""
    producer = bus.producer()
    try:
        while True:
            batch = conn.recv()
            if batch is None:
                return
            for topic, key, value, headers in batch:
                producer.publish(topic, value, key=key, headers=list(headers) or None)
            producer.flush()
    except (EOFError, OSError):
        return
    finally:
        producer.close()


class ChildPipeline:
    """The trainer's side: the child process, one forwarder down, one receiver thread up."""

    def __init__(self, runtime: "Runtime") -> None:
        bus, topics, settings = runtime.bus, runtime.topics, runtime.settings
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "spikeguard.bus.embedded_process", str(down_r), str(up_w)],
            pass_fds=(down_r, up_w), close_fds=True,
        )
        os.close(down_r)
        os.close(up_w)
        self._down = Connection(down_w, readable=False)
        self._up = Connection(up_r, writable=False)
        self._down.send(settings)  # the key crosses the pipe, never argv or the environment
        # Steps published before the child's workers run would only queue up: wait for them.
        if not self._up.poll(STARTUP_TIMEOUT_S) or self._up.recv() != READY:
            self.process.kill()
            raise BusError("the embedded pipeline process did not start "
                           f"within {STARTUP_TIMEOUT_S:.0f}s (see its stderr)")
        linger = settings.worker.embedded_batch_linger_s
        group = f"{topics.prefix}{BRIDGE_GROUP}"
        self.forwarder = Forwarder(bus, inputs_of(topics), group, self._down, linger).start()
        self.receiver = threading.Thread(target=receive, args=(bus, self._up),
                                         name="spikeguard-bridge-up", daemon=True)
        self.receiver.start()

    def close(self, timeout_s: float = 30.0) -> None:
        """Hand the child what the trainer published, let its workers save and stop, then wait."""
        self.forwarder.stop()
        try:
            self._down.send(None)
        except OSError:
            pass
        self.receiver.join(timeout=timeout_s)  # the child closes its end once its workers stopped
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("spikeguard: the embedded pipeline process did not stop; killing it")
            self.process.kill()
            self.process.wait()
        self._down.close()
        self._up.close()


def child_main(down_fd: int, up_fd: int) -> int:
    """The child: a bus, the pipeline's workers on it, and the two bridge ends."""
    from spikeguard.runtime import Runtime, make_bus, start_workers

    down = Connection(down_fd, writable=False)
    up = Connection(up_fd, readable=False)
    settings = down.recv()
    bus = make_bus(settings)
    topics = Topics(settings.topic_prefix)
    bus.create_topics(topics.compacted(), compacted=True)
    bus.create_topics(topics.all())
    bus.signing_key = settings.signing_key  # type: ignore[attr-defined]
    runtime = Runtime(bus, topics, settings)
    forwarder = Forwarder(bus, outputs_of(topics), f"{topics.prefix}{BRIDGE_GROUP}", up,
                          settings.worker.embedded_batch_linger_s)
    start_workers(runtime)
    from spikeguard.alerting.service import start_monitoring  # /metrics and alerts live here

    start_monitoring(runtime)
    up.send(READY)  # before the forwarder's first batch can use the pipe
    forwarder.start()
    receive(bus, down)  # until the trainer closes the runtime (or dies)
    runtime.close()  # the workers stop (and save) as the threads of an embedded runtime do
    forwarder.stop()
    up.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(child_main(int(sys.argv[1]), int(sys.argv[2])))
