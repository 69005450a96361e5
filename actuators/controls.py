"""The parameter side of the policy: rollbacks, LR, clipping — always within bounds.

:class:`Controls` owns what the policy has changed (LR factor, clip norm,
batch size, eps), the checkpoints it may roll back to and the rollbacks it
issued; it appends actions to a :class:`ActionPlan`. Which strategy runs when is
the policy's business (:mod:`spikeguard.actuators.policy`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from spikeguard.actuators.bounds import BatchSizeFactor, ClipNorm, Eps, LrFactor
from spikeguard.actuators.checkpoints import Checkpoint, CheckpointBook
from spikeguard.actuators.config import PolicyConfig
from spikeguard.actuators.escalation import RollbackWindow
from spikeguard.actuators.incidents import Incident
from spikeguard.actuators.action_plan import ActionPlan
from spikeguard.schemas import Decision
from spikeguard.schemas.actions import (
    ClipParams,
    HoldLrParams,
    ReduceBatchSizeParams,
    RestoreLrParams,
    RollbackParams,
    ScaleLrParams,
    SetEpsParams,
    SkipBatchesParams,
)

MAX_ROLLBACK_RECORDS = 8


@dataclass
class RollbackRecord:
    """A rollback the policy issued, until its acks settle it."""

    action_id: str
    incident: str
    issue_step: int  # the decision step it answered
    apply_at_step: int
    target_step: int
    checkpoint_id: str
    status: str = "pending"  # pending | applied | failed | timed_out
    lr_before: dict[str, Any] = field(default_factory=dict)  # LrFactor state before the rollback
    lr_scale: float = 1.0  # the SCALE_LR sent with it (1.0: none)
    # Checkpoints of the abandoned timeline, forgotten when it was issued (put back if it fails).
    dropped: list[dict[str, Any]] = field(default_factory=list)
    alerted: bool = False
    tick: int | None = None  # observed step it was issued at (its entry in the rollback window)
    # The data it skipped: from this step on, this many batches (None: it skipped none).
    skipped_from: int | None = None
    skipped: int = 0
    # The clipping its plan left tighter than the checkpoint's: given back with the LR once the
    # cause is gone (clip_before: the checkpoint's; None: no clipping).
    clip_given: bool = False
    clip_before: float | None = None
    clip_state: dict[str, Any] = field(default_factory=dict)  # ClipNorm state before it


class Controls:
    def __init__(self, config: PolicyConfig) -> None:
        cfg = self.config = config
        self.lr = LrFactor(cfg.min_lr_factor)
        self.clip = ClipNorm(
            cfg.clip_norm_initial, cfg.clip_tighten_factor, cfg.min_clip_norm, cfg.max_clip_norm
        )
        self.batch = BatchSizeFactor(cfg.min_batch_size_factor)
        self.eps = Eps(cfg.eps_initial, cfg.max_eps)
        self.book = CheckpointBook(cfg.max_checkpoints)
        self.ledger = RollbackWindow(cfg)
        self.rollbacks: list[RollbackRecord] = []

    # --- single knobs -------------------------------------------------------------
    def lower_lr(self, plan: ActionPlan, factor: float, why: str) -> bool:
        applied = self.lr.decrease(plan.apply_at_step, factor)
        if applied is None:
            return False
        plan.add(
            ScaleLrParams(factor=applied),
            f"{why}: LR x{applied:.4g} (now {self.lr.current:.4g} of base, "
            f"floor {self.lr.floor:g})",
        )
        return True

    def restore_lr(self, plan: ActionPlan, why: str, factor: float | None = None) -> bool:
        """Raise the LR one restore step (or by ``factor``), never above the ceiling."""
        applied = self.lr.restore(plan.apply_at_step, factor or self.config.lr_restore_factor)
        if applied is None:
            return False
        plan.add(
            RestoreLrParams(factor=applied),
            f"{why}: LR x{applied:.4g} (now {self.lr.current:.4g} of base)",
        )
        return True

    def lift_clip(self, plan: ActionPlan, why: str, before: float | None) -> bool:
        """Give back the clipping a recovery set: to ``before`` (None: none but the trainer's
        own). False if there is nothing to give back."""
        now = self.clip.norm
        if now is None or (before is not None and before <= now):
            return False
        self.clip.norm = before
        self.clip.mark(plan.apply_at_step)
        back = "no clipping but the trainer's own" if before is None else f"max_norm {before:g}"
        plan.add(ClipParams(mode="lift", max_norm=before), f"{why}: back to {back}")
        return True

    def clip_params(self) -> ClipParams:
        if self.config.clip_mode == "adaptive":
            return ClipParams(mode="adaptive", z=self.config.adaptive_clip_z)
        return ClipParams(max_norm=self.clip.norm)

    def tighten_clip(
        self,
        plan: ActionPlan,
        why: str,
        floor: float | None = None,
        resend: bool = False,
        tighten: bool = True,
        from_step: int | None = None,
    ) -> bool:
        """Enable clipping or tighten it one notch; ``resend`` re-sends an unchanged setting.
        ``from_step``: where the trainer has it from (default: the plan's step)."""
        changed = tighten and self.clip.enable_or_tighten(floor) is not None
        if changed or (resend and self.clip.norm is not None):
            params = self.clip_params()
            plan.add(params, f"{why}: clip {dict(params)}")
            self.clip.mark(plan.apply_at_step if from_step is None else from_step)
        return changed

    def raise_eps(self, plan: ActionPlan, why: str) -> None:
        if self.config.eps_actions and (eps := self.eps.increase(self.config.eps_increase_factor)):
            plan.add(SetEpsParams(eps=eps), f"{why}: optimizer eps -> {eps:g}")

    def reduce_batch(self, plan: ActionPlan, why: str) -> None:
        cfg = self.config
        if cfg.batch_size_actions and (f := self.batch.decrease(cfg.batch_size_decrease_factor)):
            plan.add(ReduceBatchSizeParams(factor=f), f"{why}: batch size x{f:.4g}")

    # --- the recovery itself ---------------------------------------------------------------
    def recover(
        self,
        plan: ActionPlan,
        decision: Decision,
        incident: Incident,
        tick: int,
        lr_factor: float | None,
        tighten: bool,
        why: str,
        *,
        fall_back: bool = True,
        skip_data: bool = True,
        hold_lr: bool = False,
        skip_to: int | None = None,
    ) -> bool:
        """Roll back (or, with ``fall_back``, lower the LR and skip ahead); False if it did nothing.

        ``skip_data``: skip the batches that led into it (False when the cause was not the data).
        ``skip_to``: the last step whose batch is skipped, when the evidence says where the bad
        data ended (then no margin after it); by default the decided step plus the margin.
        ``hold_lr``: the cause was a jump of the schedule: the re-run holds it (HOLD_LR).
        ``lr_factor`` None: the rollback keeps the checkpoint's LR (what was lowered since is undone).
        """
        cfg = self.config
        onset = min(incident.onset_step, decision.step)
        target = self.book.target(onset, cfg.rollback_min_steps_before_onset)
        if target is None and not fall_back:
            return False
        incident.recoveries += 1
        incident.last_recovery_tick = tick
        if target is None:
            self._fall_back(plan, decision, onset, lr_factor, tighten, why)
        else:
            self._roll_back(
                plan,
                decision,
                incident,
                tick,
                target,
                lr_factor,
                tighten,
                why,
                skip_data,
                hold_lr,
                skip_to,
            )
        return True

    def missing_target(self, incident: Incident, decision: Decision) -> str:
        """Why no checkpoint is a rollback target for ``incident`` (for the alert)."""
        return self._missing(min(incident.onset_step, decision.step))

    def _missing(self, onset: int) -> str:
        newest = self.book.healthy[-1].step if self.book.healthy else None
        return (
            f"no healthy checkpoint at least {self.config.rollback_min_steps_before_onset} steps "
            f"before onset {onset} (newest healthy: {'none' if newest is None else newest})"
        )

    def _roll_back(
        self,
        plan: ActionPlan,
        decision: Decision,
        incident: Incident,
        tick: int,
        target: Checkpoint,
        lr_factor: float | None,
        tighten: bool,
        why: str,
        skip_data: bool = True,
        hold_lr: bool = False,
        skip_to: int | None = None,
    ) -> RollbackRecord:
        cfg, t, s = self.config, target.step, decision.step
        # (where the bad data ended is known: exactly to there; else a margin past the decision)
        last, extra = (s, cfg.skip_extra_batches) if skip_to is None else (skip_to, 0)
        rollback_id = plan.add(
            RollbackParams(target_step=t, checkpoint_id=target.checkpoint_id),
            f"{why}: roll back to healthy checkpoint {target.checkpoint_id} at step {t} "
            f"(>= {cfg.rollback_min_steps_before_onset} steps before onset {incident.onset_step})",
        )
        first: int | None = None
        if skip_data:
            # From the onset: the batches between the checkpoint and the onset gave normal
            # losses, so they are re-run, not skipped (fewer batches lost than PaLM's recipe).
            first = max(t + 1, min(incident.onset_step, last))
            plan.add(
                SkipBatchesParams(from_step=first, to_step=last, extra=extra),
                f"{why}: skip the batches of steps {first}..{last} that led into it (from the "
                f"onset), plus {extra} more",
            )
        # After the rollback the LR is the lower of the one just before and the checkpoint's
        # times the strategy's factor: an incident's decreases do not compound across its rollback.
        # The factor sent is relative to the LR the guard has right after the rollback.
        lr_before, pre = self.lr.state_dict(), self.lr.current
        at_target = self.lr.rewind(t)
        if lr_factor is None:  # the LR the guard has after the rollback, unchanged
            desired = at_target if cfg.rollback_restores_lr else pre
        else:
            desired = max(self.lr.floor, min(pre, at_target * lr_factor))
        self.lr.set(t + 1, desired)  # from the re-run's first step on
        scale = desired / (at_target if cfg.rollback_restores_lr else pre)
        if scale < 1 - 1e-9:
            plan.add(
                ScaleLrParams(factor=scale),
                f"{why}: after the rollback LR x{scale:.4g} (now {desired:.4g} of base)",
            )
        else:
            scale = 1.0
        if hold_lr:
            # The schedule jumps again on the re-run: held at the rate the run trained at until
            # it comes back down, then the schedule exactly (the policy's factor is untouched).
            plan.add(
                HoldLrParams(),
                f"{why}: the re-run holds jumps of the schedule at the highest LR it trained at "
                "before the checkpoint, and gives the schedule back when it falls to it",
            )
        # The rollback reverts the clipping the guard had to the checkpoint's: send the policy's
        # again, tighter if asked (or lift the checkpoint's, when the policy lifted it since).
        clip_state = self.clip.state_dict()
        clip_before = self.clip.rewind(t)
        self.tighten_clip(plan, why, resend=True, tighten=tighten, from_step=t + 1)
        now = self.clip.norm
        if now is None and clip_before is not None:
            plan.add(ClipParams(mode="lift"), f"{why}: the checkpoint's clipping, lifted since")
            self.clip.mark(t + 1)
        # (adaptive clipping sends the same z however tight the policy's notch: only switching it
        # on changes the trainer's)
        clip_given = now is not None and (
            clip_before is None or (cfg.clip_mode != "adaptive" and now < clip_before)
        )
        self.reduce_batch(plan, why)
        dropped = self.book.drop_after(t)
        self.ledger.record(tick)
        record = RollbackRecord(
            action_id=rollback_id,
            incident=incident.key,
            issue_step=s,
            apply_at_step=plan.apply_at_step,
            target_step=t,
            checkpoint_id=target.checkpoint_id,
            lr_before=lr_before,
            lr_scale=scale,
            dropped=[asdict(c) for c in dropped],
            tick=tick,
            skipped_from=first,
            skipped=0 if first is None else last - first + 1 + extra,
            clip_given=clip_given,
            clip_before=clip_before,
            clip_state=clip_state,
        )
        self.rollbacks.append(record)
        del self.rollbacks[: max(0, len(self.rollbacks) - MAX_ROLLBACK_RECORDS)]
        return record

    def _fall_back(
        self,
        plan: ActionPlan,
        decision: Decision,
        onset: int,
        lr_factor: float | None,
        tighten: bool,
        why: str,
    ) -> None:
        cfg, s = self.config, decision.step
        missing = self._missing(onset)
        if lr_factor is not None:
            self.lower_lr(plan, lr_factor, f"{why}; {missing}, so no rollback")
        plan.add(
            SkipBatchesParams(from_step=s, to_step=s, extra=cfg.skip_extra_batches),
            f"{why}; {missing}: batches already consumed cannot be skipped without a rollback, "
            f"so skip the next {cfg.skip_extra_batches} batches ahead instead",
        )
        if tighten:
            self.tighten_clip(plan, why)
        message = f"{missing}; fell back to LR reduction and skipping ahead"
        plan.alert("warning", message, f"{why}; {missing}")

    # --- acks of rollbacks -------------------------------------------------------------------
    def record_of(self, action_id: str) -> RollbackRecord | None:
        return next((r for r in self.rollbacks if r.action_id == action_id), None)

    def pending(self) -> RollbackRecord | None:
        return next((r for r in reversed(self.rollbacks) if r.status == "pending"), None)

    def applied(self, record: RollbackRecord) -> None:
        record.status = "applied"
        self.book.drop_after(record.target_step)  # old-timeline checkpoints that came in since
        if (oldest := self.book.oldest_step) is not None:
            self.lr.forget_before(oldest)
            self.clip.forget_before(oldest)

    def failed(self, record: RollbackRecord, refused: bool = False) -> None:
        """Undo the bookkeeping of a rollback that did not happen (its SCALE_LR did).

        ``refused``: the trainer never tried it (REJECTED: signature or evidence), so its
        checkpoint is not suspect and stays a target.
        """
        record.status = "failed"
        self.lr.load_state_dict(record.lr_before)
        if record.clip_state:  # (its plan's clipping was not applied either)
            self.clip.load_state_dict(record.clip_state)
        if record.lr_scale < 1.0:
            self.lr.set(record.apply_at_step, self.lr.current * record.lr_scale)
        dropped = [Checkpoint(**c) for c in record.dropped]
        self.book.put_back(dropped, except_id=None if refused else record.checkpoint_id)
        if not refused:
            self.book.discard(record.checkpoint_id)
        # It did not happen, so it does not count against the window of rollbacks: a trainer
        # refusing rollbacks derived from forged decisions must not bring its run nearer a stop.
        self.ledger.forget(record.tick)

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "lr": self.lr.state_dict(),
            "clip_norm": self.clip.norm,
            "clip": self.clip.state_dict(),
            "batch_factor": self.batch.current,
            "eps": self.eps.value,
            "book": self.book.state_dict(),
            "ledger": self.ledger.state_dict(),
            "rollbacks": [asdict(r) for r in self.rollbacks],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr.load_state_dict(state["lr"])
        self.clip.load_state_dict(state.get("clip", {"norm": state["clip_norm"]}))
        self.batch.current = float(state["batch_factor"])
        self.eps.value = float(state["eps"])
        self.book.load_state_dict(state["book"])
        self.ledger.load_state_dict(state["ledger"])
        self.rollbacks = [RollbackRecord(**r) for r in state["rollbacks"]]
