"""The Guard's checkpointing: resume, when to save, the save itself, and telling the pipeline.

:class:`CheckpointKeeper` is owned by the Guard (``guard.checkpoints``) and is
handed what it works with when it is built: the store and its background
saver, the state parts, the ledger, the run's events, and the run's state
(:class:`~spikeguard.producers.run_state.RunState`). Periodic and requested
saves copy the state in the step and are written in the background
(async_checkpoint.py); they are published and their requests acked once on
disk, from the training thread (``CheckpointKeeper.drain``, every step).
A checkpoint is marked healthy only if the trainer saw nothing wrong at that
step (health.py).

Rotation keeps what a decision still to come may need (checkpoints.Awaiting):
the pipeline's pulses say how far it has judged (``judged``, rank 0's
:class:`~spikeguard.producers.protection.ProtectionWatch`), and with every save
rank 0 names the limit, far enough (``min_rollback_steps``, the policy's distance
before an onset) before the oldest step not judged; every rank rotates alike.

With several ranks, which checkpoint a rollback or a resume loads is decided
once, by rank 0, and shared; every rank reads it (checksums checked) and the
ranks agree before anything is applied: all load it, or all pass over it to
the next older healthy one, or all fail with the same message
(``load_agreed``; docs/distributed.md).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, NamedTuple

from spikeguard.errors import ConfigError
from spikeguard.producers import lifecycle
from spikeguard.producers.actions import ActionFailed, Outcome
from spikeguard.producers.async_checkpoint import AsyncSaver, SaveJob, SaveResult
from spikeguard.producers.checkpoints import (
    Awaiting,
    CheckpointInfo,
    CheckpointStore,
    CheckpointUnreadable,
)
from spikeguard.producers.clipping import GradClipper
from spikeguard.producers.config import GuardConfig, ResumeMode
from spikeguard.producers.distributed import RankSync, RanksFailed
from spikeguard.producers.health import HealthTracker
from spikeguard.producers.incidents import IncidentRecorder
from spikeguard.producers.io_faults import IOFaults, IOKind
from spikeguard.producers.ledger import ActionLedger, apply_restart_facts, restart_facts
from spikeguard.producers.lr import LRControl
from spikeguard.producers.parts import DataPosition, StateParts
from spikeguard.producers.run_events import RunEvents
from spikeguard.producers.run_state import RunState
from spikeguard.schemas import AckStatus, Action, CheckpointEvent

log = logging.getLogger("spikeguard.producers.guard")


class Candidate(NamedTuple):
    """A checkpoint as rank 0 names it to every rank."""

    checkpoint_id: str
    step: int
    epoch: int

    @classmethod
    def of(cls, info: CheckpointInfo) -> "Candidate":
        return cls(info.checkpoint_id, info.step, info.epoch)


class Loaded(NamedTuple):
    """What ``load_agreed`` loaded on every rank (None: nothing), and what it passed over, why."""

    info: CheckpointInfo | None
    passed: list[str]


class Saved(NamedTuple):
    """A save that reached the disk (or failed), and the event published for it (None: failed)."""

    result: SaveResult
    event: CheckpointEvent | None


class CheckpointKeeper:
    """Saves, resumes and rollback loads of one Guard's state; acks the checkpoints asked for."""

    def __init__(
        self,
        run: RunState,
        *,
        saver: AsyncSaver,
        parts: StateParts,
        ledger: ActionLedger,
        position: DataPosition,
        lr: LRControl,
        clipper: GradClipper,
        health: HealthTracker,
        incidents: IncidentRecorder,
        events: RunEvents,
        io_faults: IOFaults,
        sync: RankSync,
        config: GuardConfig,
        sharded: bool,
        ack: Callable[[Outcome], None],
        judged: Callable[[], tuple[int, int] | None] | None = None,
        min_rollback_steps: int = 0,
    ) -> None:
        self.run = run
        self.saver = saver
        self.parts = parts
        self.ledger = ledger
        self.position = position
        self.lr = lr
        self.clipper = clipper
        self.health = health
        self.incidents = incidents
        self.events = events
        self.io_faults = io_faults
        self.sync = sync
        self.rank = sync.rank
        self.config = config
        self.sharded = sharded  # a sharded model's shards are read collectively (parts.read)
        self.ack = ack
        self.judged = judged  # the newest (epoch, step) the pipeline judged (None: nobody judges)
        self.min_rollback_steps = min_rollback_steps
        self.requests: list[
            tuple[Action, str]
        ] = []  # checkpoints actions asked for, taken at step end

    @property
    def store(self) -> CheckpointStore:
        return self.saver.store  # (one store: the saver writes where the keeper reads)

    def resume(self, mode: ResumeMode | str = ResumeMode.AUTO) -> Any:
        """Continue from the newest checkpoint of this run, as ``mode`` says (config.ResumeMode).

        ``auto``: an unfinished run is resumed (the ledger always applies), a finished one is
        moved aside and started again; ``must``: resume or raise ConfigError; ``never``: earlier
        files are moved aside and the run starts from step 0. Each says so in one WARNING line
        (lifecycle.py); a run_id with no files says nothing.

        Rank 0 decides (refuse, start afresh, or which checkpoints, newest first) and every
        rank follows: a rank that starts later sees the same directory as rank 0 did.
        Returns the checkpoint resumed from (None: none).
        """
        mode = ResumeMode(mode)
        run = self.run
        self.saver.wait()
        decision: Any = None
        if self.rank == 0:
            peek = lifecycle.read_sidecar(self.store.directory)
            finished = peek is not None and bool(peek.get("finished"))
            newest = self.store.newest()
            other = lifecycle.owner((peek or {}).get("run_id"), run.run_id, self.store.list(0))
            if other is not None and not finished:
                decision = (
                    "refuse",
                    lifecycle.not_ours_message(run.run_id, other, self.store.directory),
                )
            elif mode is ResumeMode.MUST and (finished or newest is None):
                decision = (
                    "refuse",
                    f"resume='must': run {run.run_id} has "
                    f"{'only a finished run' if finished else 'no checkpoint'} in "
                    f"{self.store.directory} to resume",
                )
            elif finished or (
                mode is ResumeMode.NEVER and (peek is not None or newest is not None)
            ):
                archived = lifecycle.archive_finished(
                    self.store.directory
                )  # the directory is shared
                log.warning(
                    lifecycle.finished_message(
                        other or run.run_id, peek or {}, archived, run.run_id
                    )
                    if finished
                    else lifecycle.fresh_message(run.run_id, archived)
                )
                decision = "fresh"
            elif mode is ResumeMode.NEVER:
                decision = "fresh"
            else:
                decision = [Candidate.of(c) for c in self.store.list(0)]
        decision = self.sync.share(decision)
        if isinstance(decision, (tuple, list)) and decision and decision[0] == "refuse":
            raise ConfigError(decision[1])
        if decision == "fresh":
            return None
        side = self.ledger.read() or {}
        loaded = self.load_agreed(decision) if decision else Loaded(None, [])
        info = loaded.info
        if info is not None:
            run.step_count, run.generation = info.step, info.epoch
            log.warning(lifecycle.resume_message(run.run_id, info, self.store.directory))
        elif decision:
            log.error(
                "spikeguard: run %s: none of its %d checkpoints could be read on every rank "
                "(%s); training from step 0",
                run.run_id,
                len(decision),
                "; ".join(loaded.passed),
            )
        run.generation = max(
            run.generation, apply_restart_facts(side, self.position, self.lr, self.clipper)
        )
        return info

    # -- which checkpoint: decided once, by rank 0; loaded by every rank or by none ------
    def rollback_candidates(
        self, target_step: int, checkpoint_id: str | None, onset_step: int | None = None
    ) -> tuple[list[Candidate], str]:
        """Rank 0's choice for a rollback to ``target_step``, and the older healthy ones to fall
        back to, newest first; with a note when the named checkpoint is not the one chosen.

        ``onset_step``: the incident's onset. When nothing at or before the target is left
        (an action that arrived late finds its checkpoint rotated out), the oldest healthy
        checkpoint before the onset stands in: the nearest to what was asked, and better than
        failing the rollback, after which the policy can only stop the run.
        """
        info = self.store.find(checkpoint_id) if checkpoint_id else None
        note = ""
        if info is None or info.step > target_step:
            info = self.store.newest_healthy(max_step=target_step)
            if checkpoint_id:
                note = f" (checkpoint {checkpoint_id} not found; newest healthy at or before {target_step})"
        if info is None and onset_step is not None:
            before = [c for c in self.store.list(0) if c.healthy and c.step < onset_step]
            if before:
                info = before[-1]  # the list is newest first
                note = (
                    f" (checkpoint {checkpoint_id or 'at step ' + str(target_step)} is not on disk "
                    f"any more; the oldest healthy one before the onset {onset_step})"
                )
        if info is None:
            return [], note
        older = [c for c in self.store.list(0) if c.healthy and c.order < info.order]
        return [Candidate.of(c) for c in [info, *older]], note

    def agreed_rollback_candidates(
        self, target_step: int, checkpoint_id: str | None, onset_step: int | None = None
    ) -> tuple[list[Candidate], str]:
        """``rollback_candidates`` as rank 0 chose them, on every rank; when choosing failed there
        (a directory it cannot list), every rank fails the rollback with the same message."""
        try:
            return self.sync.decide(
                lambda: self.rollback_candidates(target_step, checkpoint_id, onset_step)
            )
        except RanksFailed as exc:
            raise ActionFailed(f"choosing the checkpoint to roll back to failed: {exc}") from None

    def load_agreed(self, candidates: list["Candidate"]) -> "Loaded":
        """Load the first of ``candidates`` (the same list on every rank) that every rank can read.

        Each rank reads its files (checksums checked), then the ranks agree: when any rank
        could not read a checkpoint, every rank passes over it to the next. A sharded
        model's shards are read (collectively) only once every rank has its files. What
        was read is applied only when every rank has it all in memory; should applying
        still fail on a rank, every rank stops with the same message (ActionFailed).
        """
        passed: list[str] = []
        for cand in candidates:
            body: dict[str, Any] = {}
            error: str | None = None
            try:
                info = self.store.find(cand.checkpoint_id)
                if info is None:
                    raise CheckpointUnreadable(f"checkpoint {cand.checkpoint_id} is not on disk")
                body = self.store.load(info)
            except CheckpointUnreadable as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - e.g. listing the directory: this rank's outcome
                error = f"{type(exc).__name__}: {exc}"[:1000]
            error = self.sync.agree(error)
            if error is None and self.sharded:
                try:
                    body = self.parts.read(body, self.rank)
                except Exception as exc:  # noqa: BLE001 - DCP raises on every rank when one fails
                    error = f"{type(exc).__name__}: {exc}"[:1000]
                error = self.sync.agree(error)
            if error is not None:
                log.error(
                    "spikeguard: checkpoint %s (step %d) cannot be loaded: %s; trying the next "
                    "older one",
                    cand.checkpoint_id,
                    cand.step,
                    error,
                )
                passed.append(f"step {cand.step} ({cand.checkpoint_id}): {error}")
                continue
            try:
                self.parts.load_state_dict(body, self.rank)
            except Exception as exc:
                log.exception("spikeguard: loading checkpoint %s failed", cand.checkpoint_id)
                error = f"{type(exc).__name__}: {exc}"[:1000]
            error = self.sync.agree(error)
            if error is not None:  # some rank's state is half loaded: no rank trains on
                message = (
                    f"loading checkpoint {cand.checkpoint_id} (step {cand.step}) failed: {error}"
                )
                self.run.request_stop(message)
                raise ActionFailed(message + "; the run stops")
            return Loaded(info, passed)
        return Loaded(None, passed)

    def persist_ledger(self) -> None:
        """The applied action ids and the run's restart facts, to the ledger file (rank 0)."""
        if self.rank == 0:
            run = self.run
            facts = restart_facts(
                run.run_id, run.generation, run.step_count, self.position, self.lr, self.clipper
            )
            if run.finished:
                facts["finished"] = lifecycle.finished_fact(run.step_count, run.generation, "close")
            self.ledger.persist(facts)

    def checkpoint(self, reason: str = "on_demand") -> CheckpointEvent:
        """Save now (state before step ``step_count``), wait until it is on disk, publish it.

        ``reason="final"`` also marks the run finished: it will not be resumed.
        (Periodic and requested checkpoints do not wait: see async_checkpoint.py.)
        """
        job = self.save(reason)
        self.saver.wait()
        for result, event in self.drain():
            if result.job is job:
                if result.error is not None:
                    raise result.error
                assert event is not None  # (a save on disk is published: drain)
                return event
        raise AssertionError("the checkpoint just saved was not handed back")  # pragma: no cover

    def request(self, action: Action, reason: str) -> None:
        """A checkpoint action: taken at the end of the step, acked once on disk."""
        self.requests.append((action, reason))

    def save_if_due(self, requests_only: bool = False) -> None:
        """At the end of a step: the checkpoints asked for, and the periodic one when due."""
        requests, self.requests = self.requests, []
        every = self.config.checkpoint_every
        periodic = not requests_only and every > 0 and self.run.step_count % every == 0
        if not (requests or periodic):
            return
        reasons = [r for _, r in requests]
        reason = "emergency" if "emergency" in reasons else "on_demand" if reasons else "periodic"
        try:
            self.save(reason, [a for a, _ in requests])  # acked once on disk (drain)
        except Exception as exc:
            log.exception("spikeguard: checkpoint failed")
            for action, _ in requests:
                self.ack(
                    Outcome(
                        action, AckStatus.FAILED, self.run.step_count, f"checkpoint failed: {exc!r}"
                    )
                )

    def save(self, reason: str, requests: list[Action] | None = None) -> SaveJob:
        """Copy the state now; the write happens in the background (AsyncSaver)."""
        run = self.run
        healthy = self.health.healthy(run.step_count) and reason not in ("emergency",)
        job = SaveJob(
            run.step_count,
            run.generation,
            healthy,
            reason,
            self.position.state_dict()["position"],
            list(requests or ()),
        )
        self.store.awaiting = self.awaiting()  # (read when this save rotates)
        self.saver.submit(lambda: self.parts.state_dict(self.rank), job)
        run.counters["checkpoints"] += 1
        run.finished = run.finished or reason == "final"
        return job

    def awaiting(self) -> Awaiting | None:
        """The rollback target decisions not made yet may need: rank 0's, on every rank."""
        mine = None
        if self.judged is not None:
            judged = self.judged()
            mine = (
                Awaiting(self.run.generation, -1)  # nothing judged yet: the oldest healthy one
                if judged is None
                else Awaiting(judged[0], judged[1] + 1 - self.min_rollback_steps)
            )
        return self.sync.share(mine) if self.sync.enabled else mine

    def drain(self) -> list[Saved]:
        """Publish (and ack) the saves that reached the disk since the last call."""
        done = []
        for r in self.saver.completed():
            job, event, info = r.job, None, r.info
            if r.error is not None or info is None:
                if isinstance(r.error, OSError):  # the disk's trouble, not the run's: once, counted
                    self.io_faults.failed(IOKind.CHECKPOINT, r.error)
                else:
                    log.error("spikeguard: checkpoint at step %d failed: %r", job.step, r.error)
                result, status = f"checkpoint failed: {r.error!r}", AckStatus.FAILED
            else:
                self.io_faults.worked(IOKind.CHECKPOINT)
                event = CheckpointEvent(
                    run_id=self.run.run_id,
                    step=job.step,
                    epoch=job.epoch,
                    checkpoint_id=info.checkpoint_id,
                    path=str(info.path),
                    healthy=job.healthy,
                    batch_index=job.batch_index,
                    reason=job.reason,
                )
                self.events.checkpoint(event, r.removed)
                result, status = (
                    f"checkpoint {event.checkpoint_id} at step {job.step}",
                    AckStatus.APPLIED,
                )
            for action in job.requests:
                self.ack(Outcome(action, status, job.step, result))
            done.append(Saved(r, event))
        if done:
            self.persist_ledger()
        return done

    def onset_of(self, action: Action) -> int:
        """The earliest step the incident may have begun at (checkpoints after it are suspect)."""
        onset = action.params.get("onset_step")
        if not isinstance(onset, int) or isinstance(onset, bool):
            onset = action.apply_at_step - self.config.detection_delay_steps
        return onset

    def keep_incident(self, action: Action) -> None:
        """The incident's batches' sample ids and its pre-onset checkpoint, for ``spikeguard inspect``."""
        if action.incident_id is not None and self.rank == 0:
            self.saver.wait()  # a checkpoint still being written is not on disk to link yet
            # Fusion's onset, the one the report shows; without it, the earliest it could be.
            onset = action.incident_onset_step
            try:
                self.incidents.incident(
                    action.incident_id,
                    self.onset_of(action) if onset is None else onset,
                    self.run.generation,
                    self.run.step_count,
                    self.store.newest_healthy,
                )
            except Exception:
                log.exception("spikeguard: keeping incident %s failed", action.incident_id)

    def incident_found(self, action: Action) -> None:
        """An anomaly action that names an incident: the incident began up to
        ``detection_delay_steps`` before it was decided (or at ``params["onset_step"]`` when the
        action says), so checkpoints taken since then are not healthy — and rotation must not
        keep one of them as "the newest healthy" in place of the last good state."""
        if action.incident_id is None:
            return  # e.g. a STOP the user asked for: no incident, nothing to distrust
        self.saver.wait()
        self.drain()
        onset = self.onset_of(action)
        # (demote: steps after the onset; the one at the onset holds the state before it, still good)
        try:
            demoted: list[CheckpointInfo] = self.store.demote(onset, self.run.generation)
        except (
            OSError
        ) as exc:  # a read-only directory: they keep their names (the policy's rollback
            self.io_faults.failed(IOKind.CHECKPOINT, exc)  # targets lie before the onset anyway)
            return
        for info in demoted:
            self.events.checkpoint(
                CheckpointEvent(
                    run_id=self.run.run_id,
                    step=info.step,
                    epoch=info.epoch,
                    checkpoint_id=info.checkpoint_id,
                    path=str(info.path),
                    healthy=False,
                ),
                [],
            )
