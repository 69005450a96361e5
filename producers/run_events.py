"""What the Guard tells the pipeline about its run: its start and end, step events, checkpoints, acks.

One place that knows the event shapes, so the Guard's step reads as a list
of decisions. Everything goes through the background publisher (training
never waits for the bus); steps may be dropped when the queue is full,
checkpoints and acks never are.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterable, Mapping

from spikeguard.schemas import Ack, CheckpointEvent, RunEvent, StepEvent, Topics, new_session


class RunEvents:
    """``session``: the nonce this Guard drew at its start, in every record it publishes (and so in
    its signature): the pipeline refuses another session's records, replayed, as not this run's."""

    def __init__(
        self,
        publisher: Any,
        topics: Topics,
        run_id: str,
        rank: int,
        all_ranks: bool,
        session: str | None = None,
    ) -> None:
        self.publisher = publisher
        self.topics = topics
        self.run_id = run_id
        self.session = session or new_session()
        self.rank = rank
        self.steps_on = publisher is not None and (rank == 0 or all_ranks)
        self.rank0_on = publisher is not None and rank == 0

    def step(
        self,
        step: int,
        epoch: int,
        stats: Any,
        *,
        lr: float,
        reason: str | None,
        loss_scale: float | None,
        overflow_streak: int,
        batch_index: int | None,
        rerun: str | None = None,
        outlier: bool = False,
        signals: Mapping[str, float] | None = None,
    ) -> None:
        """``outlier``: the Guard's own rule found the step an outlier (skipped or not);
        ``signals``: the opt-in mechanism signals' fields (producers/signals/prevention.py)."""
        if not self.steps_on:
            return
        # What the pipeline must see, and soon: kept under backlog, sent without waiting for a
        # batch. (A scaler overflow is normal: its inf gradient norm is not a non-finite value.)
        if reason == "scaler_overflow":  # its inf gradient norm is the scaler's business
            urgent = outlier or not math.isfinite(stats.loss)
        else:  # (finite: the loss and the gradient norm)
            urgent = outlier or reason is not None or not stats.finite
        values = (
            step,
            epoch,
            time.time(),
            stats,
            lr,
            reason,
            loss_scale,
            overflow_streak,
            batch_index,
            rerun,
        )
        if urgent or signals:
            fields = self.step_fields(*values)
            if signals:
                fields.update(signals)
            self.publisher.submit(self.topics.steps, StepEvent, fields, urgent=urgent)
        else:  # the field dict is made on the publisher's thread
            self.publisher.submit_step(self.topics.steps, self.step_fields, values)

    def step_fields(
        self,
        step: int,
        epoch: int,
        at: float,
        stats: Any,
        lr: float,
        reason: str | None,
        loss_scale: float | None,
        overflow_streak: int,
        batch_index: int | None,
        rerun: str | None,
    ) -> dict[str, Any]:
        """The StepEvent's fields (built into one off the training thread: publisher.py)."""
        overflow = reason == "scaler_overflow"
        return {
            "run_id": self.run_id,
            "session": self.session,
            "step": step,
            "epoch": epoch,
            "rank": self.rank,
            "time": at,
            "loss": stats.loss,
            "loss_mean": stats.loss_mean,
            "loss_ranks": stats.ranks,
            "grad_norm": None if overflow else stats.grad_norm,
            "lr": lr,
            "loss_scale": loss_scale,
            "param_norm": stats.param_norm,
            "update_norm": stats.update_norm,  # the previous step's update (update_norm.py)
            "top_grad_norms": {} if overflow else stats.top_grad_norms,
            "nonfinite_grads": 0 if overflow else stats.nonfinite_grads,
            "update_skipped": reason is not None,
            "skip_reason": reason,
            "overflow_streak": overflow_streak if overflow else 0,
            "batch_index": batch_index,
            "batch": stats.batch,
            "rerun": rerun,
        }

    def checkpoint(self, event: CheckpointEvent, removed: Iterable[Any]) -> None:
        if not self.rank0_on:
            return
        if event.session is None:
            event = event.model_copy(update={"session": self.session})
        self.publisher.submit(self.topics.checkpoints, None, event, droppable=False)
        for gone in removed:  # no longer a rollback target: say so
            self.publisher.submit(
                self.topics.checkpoints,
                None,
                CheckpointEvent(
                    run_id=self.run_id,
                    session=self.session,
                    step=gone.step,
                    epoch=gone.epoch,
                    checkpoint_id=gone.checkpoint_id,
                    path=str(gone.path),
                    healthy=gone.healthy,
                    deleted=True,
                ),
                droppable=False,
            )

    def ack(self, outcome: Any) -> None:
        if not self.rank0_on:
            return
        a = outcome.action
        self.publisher.submit(
            self.topics.acks,
            Ack,
            dict(
                run_id=self.run_id,
                session=self.session,
                action_id=a.action_id,
                kind=a.kind,
                status=outcome.status,
                step=outcome.step,
                rank=self.rank,
                result=outcome.result[:500],
                time=time.time(),
            ),
            droppable=False,
        )  # sent now: a replay puts it among the steps by it

    def run(
        self,
        kind: str,
        plan: Any,
        planned_steps: int | None,
        step: int,
        epoch: int,
        finished: bool,
        reason: str,
    ) -> None:
        """The run's start or end with its settings, on the compacted runs topic (never dropped).

        Signed with the run's key by the publisher, as steps are: the workers apply
        only a start or end the run's own Guard signed (spikeguard/streaming/run_settings_stage.py).
        """
        if not self.rank0_on:
            return
        cfg = plan.config
        self.publisher.submit(
            self.topics.runs,
            RunEvent,
            dict(
                run_id=self.run_id,
                session=self.session,
                kind=kind,
                preset=plan.preset,
                policy=plan.policy,
                fusion=plan.fusion,
                checkpoint_every=cfg.checkpoint_every,
                keep_checkpoints=cfg.keep_checkpoints,
                detection_delay_steps=cfg.detection_delay_steps,
                planned_steps=planned_steps,
                step=step,
                epoch=epoch,
                finished=finished,
                reason=reason,
                lockstep=True if cfg.lockstep else None,
            ),
            droppable=False,
        )
