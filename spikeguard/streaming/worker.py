"""The worker loop: the only code that polls, publishes and commits.

poll a batch -> decode (bad records to the DLQ with the reason) -> the stage
-> publish outputs and send them at once -> every so often flush (the broker
acknowledged every output so far), save the state of the runs that changed
with the offsets it corresponds to -> commit -> tombstone the runs that ended.
A worker never dies on a bad record, and never saves or commits past what the
broker has acknowledged.

The periodic save goes one partition at a time: each input partition is saved
every ``snapshot_interval_s`` on its own schedule, and only that partition is
committed, at the positions its saved state includes (a partition is never
committed past state that exists nowhere). A save of every partition at once
held the loop, and every step waiting on it, for the whole save. Closing and
giving partitions up save every partition at once, as before.

The loop does not wait for a batch's acknowledgements before it polls the
next (a wait per batch was a quarter of a busy worker's time, and a step
waits for whole cycles at every hop); the wait happens at the checkpoint, or
when more than ``max_unacked_records`` outputs are outstanding, so memory
stays bounded. A send that fails stops the worker at the next batch or
checkpoint, before anything past it is saved.

With a signing key the worker signs every record its stage publishes
(verdicts, decisions; the actuator signs its actions itself), and its stage
refuses inputs not signed by their producer (``Stage.admit``).

Memory follows the live runs: a run whose end the stage reads, or with no
record for ``run_idle_ttl_s``, is dropped with its per-run metric series. It
is bounded too: at most ``max_runs`` runs (a record of a further run goes to
the DLQ as TooManyRuns and is counted), and no input record over
``max_input_record_bytes`` is parsed.
When the worker cannot go on (the broker refuses what it must publish, say),
:meth:`Worker.run` returns with :attr:`Worker.failure` set and saves nothing
past what was delivered; ``spikeguard worker`` then exits non-zero.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from functools import partial
from typing import Any, Callable, Mapping
from itertools import repeat
from operator import attrgetter, is_not, itemgetter

from pydantic import BaseModel

from spikeguard.bus import Bus, Record
from spikeguard.deadletters import dead_letter
from spikeguard.errors import (
    CommitRefused,
    DeliveryError,
    RecordNotAuthenticated,
    RecordRejected,
    SchemaError,
    StepNotAuthenticated,
    TooManyRuns,
)
from spikeguard.metrics import (
    Metrics,
    default_metrics,
    observe_ignored,
    observe_inputs,
    observe_outputs,
)
from spikeguard.streaming.batch_transaction import handle_batch
from spikeguard.streaming.checkpointer import Checkpointer
from spikeguard.streaming.config import DEFAULT_MAX_INPUT_RECORD_BYTES, DEFAULT_MAX_RUNS
from spikeguard.streaming.run_sweep import RunSweep
from spikeguard.streaming.stage import Output, Stage
from spikeguard.streaming.state_store import DEFAULT_MAX_RECORD_BYTES, StateStore
from spikeguard.schemas import Ack, Decision, StepEvent, StepVerdicts, Verdict, decode, encode
from spikeguard.schemas.signing import SIGNERS, Signer, describe_type
from spikeguard.streaming.refusal_log import RefusalLog

log = logging.getLogger(__name__)

_TOPIC = attrgetter("topic")
_PARTITION = attrgetter("partition")
_TIMESTAMP = attrgetter("timestamp_ms")
_RUN_ID = attrgetter("run_id")
_EVENT = itemgetter(1)
_TOPIC_OF_OUTPUT = itemgetter(0)
_IS_NOT_NONE = partial(is_not, None)
# How a signed record's JSON carries its signature (an unsigned one has "signature":null or none).
_SIGNED = b'"signature":"'
_PER_STEP = (StepEvent, Verdict, StepVerdicts, Decision)


def unsigned_refusal(
    models: Mapping[str, type[BaseModel]],
) -> dict[str, Callable[[str | None], RecordRejected]]:
    """Per input topic of a record type that comes once a step (steps, verdicts, decisions): the
    refusal of a record that carries no signature, made unparsed.

    The same error class and reason as :func:`~spikeguard.schemas.signing.authenticate` gives
    after parsing, at a fraction of the cost: a flood of unsigned records is dropped, not parsed.
    The rarer records (run events, checkpoints, acks) are parsed first, so that their refusal
    says which record it was.
    """

    def refusal(model: type[BaseModel]) -> Callable[[str | None], RecordRejected]:
        error = StepNotAuthenticated if issubclass(model, StepEvent) else RecordNotAuthenticated
        what = describe_type(model)
        signer = SIGNERS.get(model, "its producer")

        def make(run_id: str | None) -> RecordRejected:
            return error(
                f"run {run_id or '?'}: no signature (an unsigned {what}; {signer} signs it: "
                "forged, or from a process without the key); refused unparsed"
            )

        return make

    return {
        topic: refusal(model) for topic, model in models.items() if issubclass(model, _PER_STEP)
    }


class Worker:
    """Runs one stage against a bus, as one member of the stage's consumer group."""

    def __init__(
        self,
        bus: Bus,
        stage: Stage,
        *,
        metrics: Metrics | None = None,
        snapshots: bool = True,
        snapshot_interval_s: float = 2.0,
        max_records: int = 1000,
        poll_timeout_s: float = 0.2,
        run_idle_ttl_s: float = 3600.0,
        max_state_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        clock: Callable[[], float] = time.time,
        metrics_linger_s: float = 60.0,
        batch_linger_s: float = 0.0,
        max_unacked_records: int = 10_000,
        max_runs: int = DEFAULT_MAX_RUNS,
        max_input_record_bytes: int = DEFAULT_MAX_INPUT_RECORD_BYTES,
        unsigned_letters_per_interval: int = 1000,
    ) -> None:
        self.bus = bus
        # Dead letters written for unsigned records per 10 s at most (RefusalLog); the rest counted.
        self.unsigned_letters_per_interval = unsigned_letters_per_interval
        self.stage = stage
        self.metrics = metrics or default_metrics()
        self.max_records = max_records
        self.poll_timeout_s = poll_timeout_s
        self.snapshot_interval_s = snapshot_interval_s
        self.run_idle_ttl_s = run_idle_ttl_s
        self.clock = clock  # wall time: idle eviction and the stage's deadlines
        # Woken by fewer than max_records, wait this long for more: one wake-up, snapshot,
        # flush and round of metrics per batch, not per record, for that much latency.
        self.batch_linger_s = batch_linger_s
        # Outputs sent but not yet acknowledged before the loop waits for them (0: after every batch).
        self.max_unacked_records = max_unacked_records
        # A flood of made-up run ids or one huge record must not grow the worker without bound.
        self.max_runs = max_runs
        self.max_input_record_bytes = max_input_record_bytes
        # With a key, every record this worker publishes is signed by it (verdicts, decisions):
        # the next stage takes no others.
        self.signer = Signer(stage.signing_key)
        #: Why the loop stopped on its own (None: it was stopped, or still runs).
        self.failure: BaseException | None = None
        topics = stage.topics
        self.group = f"{topics.prefix}{stage.name}"
        self.dlq_topic = topics.dlq
        self._models = stage.inputs()
        self._admit = getattr(stage, "admit", None)  # optional: (topic, event) -> None or raises
        # observe_inputs looks at steps and acks only: other stages skip it.
        self._reads_steps_or_acks = any(
            issubclass(model, (StepEvent, Ack)) for model in self._models.values()
        )
        unreadable = self.metrics.unreadable_snapshots.labels(stage.name).inc
        self._store = (
            StateStore(
                bus,
                topics.state(stage.name),
                on_unreadable=unreadable,
                component=stage.name,
                max_record_bytes=max_state_record_bytes,
                on_refused=self.metrics.state_refused.labels(stage.name).inc,
            )
            if snapshots
            else None
        )
        self._saver = (
            Checkpointer(self._store, stage, self._models, self.group, on_unadoptable=unreadable)
            if self._store
            else None
        )
        self._producer = bus.producer()
        # Which partition each run in memory came from (to forget it when the partition moves).
        self._run_partition: dict[str, int] = {}
        self._sweep = RunSweep(stage, self.metrics, run_idle_ttl_s, metrics_linger_s, self.group)
        self._stop = threading.Event()
        self._revoke_failure: DeliveryError | None = None
        self._refusals = RefusalLog(log, self.group)  # a flood is a few log lines, not one each
        # With a key, a record that carries no signature is refused before it is parsed.
        self._unsigned = unsigned_refusal(self._models) if self.signer.enabled else None
        self._unsigned_counters: dict[str, Any] = {}
        # Compacted inputs (the runs topic) may hold tombstones: no event, nothing to judge.
        self._compacted = {topics.runs} & set(self._models)
        bus.create_topics(list(self._compacted), compacted=True)
        bus.create_topics([t for t in self._models if t not in self._compacted] + [self.dlq_topic])
        if self._store is not None:
            self._store.ensure_topic()
        self._consumer = bus.consumer(
            self.group, list(self._models), on_assign=self._on_assign, on_revoke=self._on_revoke
        )

    # -- the loop -------------------------------------------------------------
    def run(self) -> None:
        """Poll and process until :meth:`stop`; then save state and leave the group."""
        try:
            while not self._stop.is_set():
                self.run_once()
        except Exception as exc:
            self.failure = exc
            log.error(
                "%s: cannot go on: %s: %s", self.group, type(exc).__name__, exc, exc_info=True
            )
        finally:
            self.close()

    @property
    def failure_reason(self) -> str | None:
        """One line saying why the loop stopped on its own, or None."""
        if self.failure is None:
            return None
        text = " ".join(str(self.failure).split()) or "(no message)"
        return f"{self.stage.name}: {type(self.failure).__name__}: {text[:500]}"

    def run_once(self, timeout: float | None = None) -> int:
        """One poll-process-publish cycle; returns how many records it consumed."""
        records = self._consumer.poll(
            self.max_records, self.poll_timeout_s if timeout is None else timeout
        )
        if records and self.batch_linger_s > 0 and len(records) < self.max_records:
            self._pause(self.batch_linger_s)
            records += self._consumer.poll(self.max_records - len(records), 0)
        if (
            self._revoke_failure is not None
        ):  # a delivery failure the rebalance callback (in poll) saw
            raise self._revoke_failure
        started = time.perf_counter()
        now = self.clock()
        outputs = self._process(records, now) if records else []
        ticked = self.stage.tick(now)
        if ticked:
            if self._saver is not None:  # a deadline that decides changes its run's state
                self._saver.changed(map(_RUN_ID, map(_EVENT, ticked)))
            outputs += ticked
        outputs += self._sweep.evict_idle(now)
        self._drop_ended(now)
        self._refusals.summary()
        self._publish(outputs)
        if records or outputs:
            self._send()
        if records:
            observe_ignored(self.metrics, self.stage)
            self.metrics.batch_seconds.labels(self.stage.name).observe(
                time.perf_counter() - started
            )
        if self._saver is None:
            if records:
                self._commit()
        elif self._saver.pending:
            due = self._saver.due(time.monotonic(), self.snapshot_interval_s, self._run_partition)
            if due:
                self.checkpoint(due)
        return len(records)

    def _send(self) -> None:
        """Send what the batch published; wait for acknowledgements only when it must."""
        producer = self._producer
        if self._saver is None or self.max_unacked_records <= 0:
            producer.flush()  # commits follow every batch: they need its acknowledgements
            return
        producer.send_now()
        if producer.unacknowledged() > self.max_unacked_records:
            producer.flush()

    def _pause(self, seconds: float) -> None:  # the stop event: stop() cuts it short
        self._stop.wait(seconds)

    def _evict_idle(self, now: float) -> list[Output]:
        return self._sweep.evict_idle(now, force=True)

    def _drop_ended(self, now: float) -> None:
        """Forget the runs the stage ended: their partition entry, their metrics; queue tombstones."""
        partitions: dict[str, int] = {}
        ended = self._sweep.ended(now, self._run_partition, partitions)
        if ended and self._saver is not None:
            self._saver.ended(ended, partitions)

    def drain(self) -> list[Output]:
        """End of input: let the stage emit what it still holds, and publish it."""
        outputs = self.stage.flush()
        self._publish(outputs)
        self._producer.flush()
        return outputs

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        # After a failure, outputs of the last batch may be undelivered: saving or
        # committing now would skip them for good. The next start redoes them.
        if self.failure is None:
            try:
                self._producer.flush()
                if self._saver is not None:
                    self.checkpoint()
                else:
                    self._commit()
            except Exception:  # closing must not hide the error that stopped the loop
                log.exception("%s: could not save state on close", self.group)
        self._consumer.close()
        self._producer.close()

    # -- processing -----------------------------------------------------------
    def _process(self, records: list[Record], now: float) -> list[Output]:
        live = records
        if self._saver is not None:
            self._saver.advance(records)
            live = self._saver.unseen(records)
        if self._compacted:
            live = [r for r in live if r.topic not in self._compacted or r.value is not None]
        items, sources = self._decode(live)
        self._track(records, sources, items)
        if not items:
            return []
        # The batch is a transaction on the state of its runs: a failure puts them back
        # as they were and retries record by record, so only the record that fails goes
        # to the DLQ, with its own reason (and none of its effects), and nothing counts twice.
        run_ids = set(map(_RUN_ID, map(_EVENT, items)))
        self.stage.touch(run_ids, now)
        if self._saver is not None:
            self._saver.changed(run_ids)

        def failed(index: int, exc: Exception) -> None:
            record = sources[index]
            log.exception(
                "%s: record %s[%d]@%d failed",
                self.group,
                record.topic,
                record.partition,
                record.offset,
            )
            self._to_dlq(record, exc)

        return handle_batch(self.stage, items, failed, self.group, run_ids)

    # A step crosses ~8 worker hops in a backtest, so the per-record work here
    # is kept to what needs Python; the rest goes through map/zip (C speed).
    def _decode(self, records: list[Record]) -> tuple[list[tuple[str, BaseModel]], list[Record]]:
        """The ``(topic, event)`` pairs and their records; the undecodable go to the DLQ."""
        items, sources = self._decode_all(records)
        held = getattr(self.stage, "runs", None)
        # A stage may refuse decodable records (unauthenticated or replayed steps, far-future
        # steps, bad run settings): they go to the DLQ with the stage's reason, before any
        # state sees them; so do the records of a run beyond the number of runs it may hold.
        kept: list[tuple[str, BaseModel]] = []
        kept_sources: list[Record] = []
        admit = self._admit
        if admit is None and (held is None or len(held) < self.max_runs - len(items)):
            return items, sources
        new_runs: set[str] = set()
        for item, record in zip(items, sources):
            try:
                run_id = item[1].run_id  # type: ignore[attr-defined]
                if held is not None:  # before the stage's checks, which may keep a little per run
                    self._room_for(run_id, held, new_runs)
                if admit is not None:
                    admit(*item)
                if held is not None and run_id not in held:
                    new_runs.add(run_id)
            except RecordRejected as exc:
                self._to_dlq(record, exc)
                continue
            kept.append(item)
            kept_sources.append(record)
        return kept, kept_sources

    def _room_for(self, run_id: str, held: dict, new_runs: set[str]) -> None:
        """Raise TooManyRuns when ``run_id`` would be one run more than the stage may hold."""
        if run_id in held or run_id in new_runs:
            return
        if len(held) + len(new_runs) >= self.max_runs:
            self.metrics.runs_refused.labels(self.stage.name).inc()
            raise TooManyRuns(
                f"run {run_id}: this {self.stage.name} worker already holds {len(held) + len(new_runs)} "
                f"runs, its limit (worker.max_runs={self.max_runs}); refused until runs end or idle out "
                "(a flood of made-up run ids, or raise the limit)"
            )

    def _decode_all(
        self, records: list[Record]
    ) -> tuple[list[tuple[str, BaseModel]], list[Record]]:
        models = self._models
        if len(models) == 1:  # fusion: one input topic
            ((topic, model),) = models.items()
            events = [record.cached(model) for record in records]
            if all(map(_IS_NOT_NONE, events)):  # all decoded already (the embedded bus)
                return list(zip(repeat(topic), events)), records
        else:
            events = [record.cached(models[record.topic]) for record in records]
            if all(map(_IS_NOT_NONE, events)):
                return list(zip(map(_TOPIC, records), events)), records
        items: list[tuple[str, BaseModel]] = []
        sources: list[Record] = []
        limit = self.max_input_record_bytes
        unsigned = self._unsigned
        for record in records:
            try:
                raw = (
                    record._value
                )  # the bytes as received; an in-process event is not encoded for this
                if (
                    raw is not None and len(raw) > limit
                ):  # refused unparsed (worker.max_input_record_bytes)
                    decode(raw, self._models[record.topic], max_bytes=limit)
                if (
                    unsigned is not None
                    and raw is not None
                    and record.topic in unsigned
                    and _SIGNED not in raw
                ):
                    self._refuse_unsigned(record, unsigned[record.topic](record.key_text))
                    continue
                event = record.decoded(self._models[record.topic])
            except SchemaError as exc:
                self._to_dlq(record, exc)
                continue
            items.append((record.topic, event))
            sources.append(record)
        return items, sources

    def _track(
        self, records: list[Record], sources: list[Record], items: list[tuple[str, BaseModel]]
    ) -> None:
        """Positions, runs per partition and input metrics of one polled batch."""
        # Which partition each run came from (to forget its runs when it moves away).
        partitions = set(map(_PARTITION, sources))
        if len(partitions) == 1:
            self._run_partition.update(
                zip(map(_RUN_ID, map(_EVENT, items)), repeat(partitions.pop()))
            )
        else:
            self._run_partition.update(
                zip(map(_RUN_ID, map(_EVENT, items)), map(_PARTITION, sources))
            )
        # Counted per batch, not per record: label look-ups cost a microsecond each.
        name = self.stage.name
        topics = (
            Counter(map(_TOPIC, records))
            if len(self._models) > 1
            else {records[0].topic: len(records)}
        )
        for topic, count in topics.items():
            self.metrics.records_in.labels(name, topic).inc(count)
        # No timestamp is 0 (the usual case): the plain minimum is the oldest.
        oldest = min(map(_TIMESTAMP, records))
        if not oldest:
            oldest = min((r.timestamp_ms for r in records if r.timestamp_ms), default=0)
        if oldest:
            self.metrics.lag_seconds.labels(name).observe(max(0.0, time.time() - oldest / 1000))
        if self._reads_steps_or_acks:
            observe_inputs(self.metrics, items)

    def _publish(self, outputs: list[Output]) -> None:
        if not outputs:
            return
        signer = self.signer
        if signer.enabled:
            outputs[:] = [(topic, signer.sign(event)) for topic, event in outputs]
        self._producer.publish_events(outputs)
        for topic, count in Counter(map(_TOPIC_OF_OUTPUT, outputs)).items():
            self.metrics.records_out.labels(self.stage.name, topic).inc(count)
        observe_outputs(self.metrics, outputs)

    def _refuse_unsigned(self, record: Record, exc: RecordRejected) -> None:
        """An unsigned record, refused unparsed: to the DLQ up to a number per interval, then counted."""
        if self._refusals.write_unsigned(self.unsigned_letters_per_interval):
            self._to_dlq(record, exc)
            return
        error = type(exc).__name__
        self._refusals.said(error)  # counted in the interval's summary line
        counter = self._unsigned_counters.get(error)
        if counter is None:  # a label look-up costs more than the rest of the refusal
            counter = self._unsigned_counters[error] = self.metrics.dead_letters.labels(
                self.stage.name, error
            )
        counter.inc()

    def _to_dlq(self, record: Record, exc: BaseException) -> None:
        letter = dead_letter(record, exc, self.group)
        if self._refusals.said(letter.error):
            log.warning(
                "%s: %s[%d]@%d to the DLQ: %s",
                self.group,
                record.topic,
                record.partition,
                record.offset,
                letter.reason,
            )
        self._producer.publish(self.dlq_topic, encode(letter), key=record.key)
        self.metrics.dead_letters.labels(self.stage.name, letter.error).inc()

    # -- state ----------------------------------------------------------------
    def checkpoint(self, partitions: list[int] | None = None) -> None:
        """Save the runs changed since the last checkpoint and the positions, commit, then tombstone.

        ``partitions``: only these input partitions, each committed at the positions just
        saved for it (None: every partition, and the commit covers everything polled).
        """
        # Every output sent so far must be acknowledged before a state or an offset past
        # its input is: a failure raises here, and nothing is saved.
        self._producer.flush()
        if self._saver is None:
            self._commit()
            return
        saved = self._saver.save(self._producer, self._run_partition, partitions, time.monotonic())
        self._producer.flush()
        if not self._commit(None if partitions is None else saved):
            return  # ended runs keep their state until a commit covers their last records
        if self._saver.tombstone(self._producer, getattr(self.stage, "runs", ()), partitions):
            self._producer.flush()

    def _commit(self, offsets: Mapping[tuple[str, int], int] | None = None) -> bool:
        """Commit the positions (``offsets``: only these); False when the group moved on without this member.

        After a broker outage longer than the session the group has evicted this member:
        its next poll rejoins, the lost partitions' runs are saved and dropped (on_revoke),
        and the ones assigned again come back from their snapshot, so the loop goes on.
        """
        try:
            self._consumer.commit(offsets)
        except CommitRefused as exc:
            log.warning("%s: %s; it rejoins at its next poll", self.group, exc)
            return False
        return True

    def _on_assign(self, gained: set[tuple[str, int]]) -> None:
        if self._saver is not None:
            self._saver.assign(gained, self._consumer, self._run_partition)

    def _on_revoke(self, lost: set[tuple[str, int]]) -> None:
        # Save what we have before the partitions move, then let go of their runs.
        if self._saver is not None and self._saver.pending:
            try:
                self.checkpoint()
            except DeliveryError as exc:
                # Outputs of partitions kept may be lost too: the loop stops on it (not here,
                # inside the consumer's poll), before its next checkpoint saves past them.
                self._revoke_failure = exc
                log.exception("%s: snapshot on revoke failed", self.group)
            except Exception:
                log.exception("%s: snapshot on revoke failed", self.group)
        partitions = {p for _, p in lost}
        gone = [run for run, p in self._run_partition.items() if p in partitions]
        self.stage.forget(gone)
        for run_id in gone:
            del self._run_partition[run_id]
        if self._saver is not None:
            self._saver.revoke(lost, gone)
