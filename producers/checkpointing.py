"""The Guard's checkpointing: when to save, the save itself, and telling the pipeline.

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

from spikeguard.producers.actions import Outcome
from spikeguard.producers.async_checkpoint import SaveJob
from spikeguard.schemas import AckStatus, Action, CheckpointEvent

log = logging.getLogger("spikeguard.producers.guard")


class Checkpointing:
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
