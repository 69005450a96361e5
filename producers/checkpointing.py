"""The Guard's checkpointing: resume, when to save, the save itself, and telling the pipeline.

A mixin of the Guard (its attributes: ``saver``, ``health``, ``position``,
``parts``, ``events``, ``counters``), kept apart so guard.py reads as the step.
Periodic and requested saves copy the state in the step and are written in
the background (async_checkpoint.py); they are published and their requests
acked once on disk, from the training thread (``_drain_saves``, every step).
A checkpoint is marked healthy only if the trainer saw nothing wrong at that
step (health.py).
"""

from __future__ import annotations

import logging
from typing import Any

from spikeguard.errors import ConfigError
from spikeguard.producers import lifecycle
from spikeguard.producers.config import ResumeMode
from spikeguard.producers.actions import Outcome
from spikeguard.producers.async_checkpoint import SaveJob
from spikeguard.producers.ledger import apply_restart_facts, restart_facts
from spikeguard.schemas import AckStatus, Action, CheckpointEvent

log = logging.getLogger("spikeguard.producers.guard")


class Checkpointing:
    def resume(self, mode: ResumeMode | str = ResumeMode.AUTO) -> Any:
        """Continue from the newest checkpoint of this run, as ``mode`` says (config.ResumeMode).

        ``auto``: an unfinished run is resumed (the ledger always applies), a finished one is
        moved aside and started again; ``must``: resume or raise ConfigError; ``never``: earlier
        files are moved aside and the run starts from step 0. Each says so in one WARNING line
        (lifecycle.py); a run_id with no files says nothing.
        """
        mode = ResumeMode(mode)
        self.saver.wait()
        peek = lifecycle.read_sidecar(self.store.directory)
        finished = peek is not None and bool(peek.get("finished"))
        if mode is ResumeMode.MUST and (finished or self.store.newest() is None):
            raise ConfigError(f"resume='must': run {self.run_id} has "
                              f"{'only a finished run' if finished else 'no checkpoint'} in "
                              f"{self.store.directory} to resume")
        if finished or (mode is ResumeMode.NEVER and (peek is not None or self.store.newest() is not None)):
            if self.rank == 0:  # the directory is shared: one rank moves it aside
                archived = lifecycle.archive_finished(self.store.directory)
                log.warning(lifecycle.finished_message(self.run_id, peek or {}, archived) if finished
                            else lifecycle.fresh_message(self.run_id, archived))
            return None
        if mode is ResumeMode.NEVER:
            return None
        side = self.ledger.read() or {}
        info = self.store.newest()
        if info is not None:
            self.load_state_dict(self.store.load(info))
            self.step_count, self.epoch = info.step, info.epoch
            self.resumed_from = info  # (its checkpoint is on disk: _start saves no initial one)
            log.warning(lifecycle.resume_message(self.run_id, info, self.store.directory))
        self.epoch = max(self.epoch, apply_restart_facts(side, self.position, self.lr, self.clipper))
        return info

    def _persist_ledger(self) -> None:
        if self.rank == 0:
            facts = restart_facts(self.run_id, self.epoch, self.step_count, self.position, self.lr,
                                  self.clipper)
            if self.finished:
                facts["finished"] = lifecycle.finished_fact(self.step_count, self.epoch, "close")
            self.ledger.persist(facts)

    def checkpoint(self, reason: str = "on_demand") -> CheckpointEvent:
        """Save now (state before step ``step_count``), wait until it is on disk, publish it.

        ``reason="final"`` also marks the run finished: it will not be resumed.
        (Periodic and requested checkpoints do not wait: see async_checkpoint.py.)
        """
        job = self._save(reason)
        self.saver.wait()
        for result, event in self._drain_saves():
            if result.job is job:
                if result.error is not None:
                    raise result.error
                return event
        raise AssertionError("the checkpoint just saved was not handed back")  # pragma: no cover

    def request_checkpoint(self, action: Action, reason: str) -> None:
        self._checkpoint_requests.append((action, reason))

    def _maybe_checkpoint(self, requests_only: bool = False) -> None:
        requests, self._checkpoint_requests = self._checkpoint_requests, []
        every = self.config.checkpoint_every
        periodic = not requests_only and every > 0 and self.step_count % every == 0
        if not (requests or periodic):
            return
        reasons = [r for _, r in requests]
        reason = "emergency" if "emergency" in reasons else "on_demand" if reasons else "periodic"
        try:
            self._save(reason, [a for a, _ in requests])  # acked once on disk (_drain_saves)
        except Exception as exc:  # noqa: BLE001 - running out of memory for the copy must not kill training
            log.exception("spikeguard: checkpoint failed")
            for action, _ in requests:
                self._ack(Outcome(action, AckStatus.FAILED, self.step_count, f"checkpoint failed: {exc!r}"))

    def _save(self, reason: str, requests: list[Action] | None = None) -> SaveJob:
        """Copy the state now; the write happens in the background (AsyncSaver)."""
        healthy = self.health.healthy(self.step_count) and reason not in ("emergency",)
        job = SaveJob(self.step_count, self.epoch, healthy, reason,
                      self.position.state_dict()["position"], list(requests or ()))
        self.saver.submit(lambda: self.parts.state_dict(self.rank), job)
        self.counters["checkpoints"] += 1
        self.finished = self.finished or reason == "final"
        return job

    def _drain_saves(self) -> list[tuple[Any, CheckpointEvent | None]]:
        """Publish (and ack) the saves that reached the disk since the last call."""
        done = []
        for r in self.saver.completed():
            job, event = r.job, None
            if r.error is not None:
                log.error("spikeguard: checkpoint at step %d failed: %r", job.step, r.error)
                result, status = f"checkpoint failed: {r.error!r}", AckStatus.FAILED
            else:
                event = CheckpointEvent(run_id=self.run_id, step=job.step, epoch=job.epoch,
                                        checkpoint_id=r.info.checkpoint_id, path=str(r.info.path),
                                        healthy=job.healthy, batch_index=job.batch_index, reason=job.reason)
                self.events.checkpoint(event, r.removed)
                result, status = f"checkpoint {event.checkpoint_id} at step {job.step}", AckStatus.APPLIED
            for action in job.requests:
                self._ack(Outcome(action, status, job.step, result))
            done.append((r, event))
        if done:
            self._persist_ledger()
        return done

    def _onset_of(self, action: Action) -> int:
        onset = action.params.get("onset_step")
        if not isinstance(onset, int) or isinstance(onset, bool):
            onset = action.apply_at_step - self.config.detection_delay_steps
        return onset

    def _keep_incident(self, action: Action) -> None:
        """The incident's batches' sample ids and its pre-onset checkpoint, for ``spikeguard inspect``."""
        if action.incident_id is not None and self.rank == 0:
            self.saver.wait()  # a checkpoint still being written is not on disk to link yet
            self.incidents.incident(action.incident_id, self._onset_of(action), self.epoch,
                                    self.step_count, self.store.newest_healthy)

    def _incident_found(self, action: Action) -> None:
        """An anomaly action that names an incident: the incident began up to
        ``detection_delay_steps`` before it was decided (or at ``params["onset_step"]`` when the
        action says), so checkpoints taken since then are not healthy — and rotation must not
        keep one of them as "the newest healthy" in place of the last good state."""
        if action.incident_id is None:
            return  # e.g. a STOP the user asked for: no incident, nothing to distrust
        self.saver.wait()
        self._drain_saves()
        onset = self._onset_of(action)
        # (demote: steps after the onset; the one at the onset holds the state before it, still good)
        for info in self.store.demote(onset, self.epoch):
            self.events.checkpoint(CheckpointEvent(
                run_id=self.run_id, step=info.step, epoch=info.epoch, checkpoint_id=info.checkpoint_id,
                path=str(info.path), healthy=False), [])
