"""The Guard: what a plain PyTorch loop adds to be kept alive through spikes.

    guard = Guard(model, optimizer, scheduler, run_id="my-run")
    for x, y in guard.data(loader):            # was: for x, y in loader
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        guard.step(loss)                         # was: optimizer.step(); scheduler.step()
    guard.close()

What it does is said out loud: one WARNING line per action that changes the run
(what, why, its cost, the incident), and ``close()`` logs and returns the run's
summary (``summary()`` any time; narration.py). ``mode="observe"`` runs the whole
pipeline and applies nothing, saying what it would do; ``mode="skip-only"`` takes
only the Guard's own update skips (config.GuardMode). Recoveries are bounded by a
budget (budget.py). A loop that keeps its own step count follows rollbacks with
``guard.on_rollback(fn)`` or reads ``guard.step_count``. ``docs/guard.md`` is the
user's guide to all of it.

With gradient accumulation, iterate ``guard.data(loader)`` for the micro-batches
and call ``guard.step(mean_loss)`` once per optimizer step, after the last
backward: steps, checkpoints and skip windows count optimizer steps.

Each ``step`` computes the step's statistics with one device-to-host transfer,
applies the actions due at this step (before this step's update), skips the
update at once when the loss or gradient is non-finite or the step is an
isolated outlier (skip_rule.py), publishes the
StepEvent without waiting (drop-oldest queue), updates, and checkpoints when
due (a CPU copy in the step, written in the background: async_checkpoint.py).
A restarted run_id resumes with a WARNING (``resume="auto"``, the default; "must"
and "never" as config.ResumeMode says); a finished one is not resumed
(lifecycle.py). The run's preset and policy are checked when the Guard is
built and published on the runs topic (run_plan.py). Step numbers count
``step`` calls; a checkpoint "at step s" holds the state before step s runs.
After a rollback to s the step counter is s again and the rollback generation
(``generation``: rollbacks applied so far) one higher. Events and checkpoints
carry it in their ``epoch`` field (the wire's name, kept so that recorded
topics and files still read); ``guard.data(..., epochs=)`` counts data passes.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import torch

from spikeguard.producers.amp import ScalerControl
from spikeguard.producers.async_checkpoint import AsyncSaver
from spikeguard.producers.applying import Acknowledgements, ActionApplier, Gate
from spikeguard.producers.checkpointing import CheckpointKeeper
from spikeguard.producers.actions import ActionFailed, ActionQueue, Handler, Outcome, apply_action
from spikeguard.producers.budget import RecoveryBudget, Spend
from spikeguard.producers.checkpoints import CheckpointInfo, CheckpointStore
from spikeguard.producers.clipping import GradClipper
from spikeguard.producers.config import GuardConfig, GuardMode, ResumeMode
from spikeguard.producers.data import GuardedLoader
from spikeguard.producers.distributed import RankSync, RanksFailed
from spikeguard.producers.evidence import own_view
from spikeguard.producers.health import HealthTracker
from spikeguard.producers.inbox import ActionInbox
from spikeguard.producers.io_faults import IOFaults
from spikeguard.producers.protection import ProtectionWatch
from spikeguard.producers.refusals import RefusalWatch
from spikeguard.producers.ledger import SIDECAR, ActionLedger
from spikeguard.producers.lockstep import DecisionWaiter
from spikeguard.producers.lr import LRControl
from spikeguard.producers.misuse import StepWatch, check_loss, guard_options_error
from spikeguard.integrations.loggers import loggers_from
from spikeguard.producers.narration import STEERING, Cost, Narrator, RunSummary, would_do
from spikeguard.producers.parts import DataPosition, ModelPart, RNGPart, StateParts
from spikeguard.producers.publisher import BackgroundPublisher
from spikeguard.producers.run_events import RunEvents
from spikeguard.producers.run_plan import make_plan
from spikeguard.producers.sharded import ShardedState, model_is_sharded
from spikeguard.producers.incidents import IncidentRecorder
from spikeguard.producers.rerun import RerunCheck
from spikeguard.producers.skip_rule import SkipDecision, SkipRule, StepJudged
from spikeguard.producers.skip_samples import SkipIds, leave_out
from spikeguard.producers.stats import GradStats, StepStats, across_ranks
from spikeguard.producers.update import torch_optimizer, void_update
from spikeguard.producers.update_norm import UpdateNorm
from spikeguard.schemas import (
    WITHHELD,
    AckStatus,
    Action,
    ActionKind,
    CheckpointEvent,
    Topics,
    new_session,
)
from spikeguard.schemas.signing import Signer

if TYPE_CHECKING:
    from spikeguard.runtime import Runtime

log = logging.getLogger(__name__)

#: Why a step's update does not happen, besides the skip reasons a StepEvent publishes:
#: a rollback or stop applied in its first half (the step is not published)...
INTERRUPTED = "interrupted"
#: ...or the step read data a skip window covers (a framework's stream; not published either).
SKIPPED_DATA = "skipped_data"


class FirstHalf(NamedTuple):
    """What ``before_update`` found, for ``after_update`` to publish and count."""

    step: int
    stats: StepStats
    reason: (
        str | None
    )  # why the update is void (None: applied; "scaler_overflow": the scaler skipped it)
    nonfinite: bool
    overflow: bool  # the scaler's own overflow: inf/NaN gradients with a finite loss
    scored: SkipDecision | None  # the local outlier model's judgement (evidence.py)
    rerun: str | None  # a re-run's verdict (rerun.py)
    loss_scale: float | None
    lr: float  # the LR this update used (the Guard's factor included)


class StepResult(NamedTuple):
    """How a guarded step ended."""

    updated: bool  # the update was applied
    interrupted: bool  # a rollback or stop ended the step before its update


class Guard:
    """Guards one training run; see the module's docstring.

    Where its steps go: by default the Guard opens a runtime of its own
    (:func:`spikeguard.runtime.open_runtime`: the embedded pipeline, or Kafka
    when ``SPIKEGUARD_BOOTSTRAP_SERVERS`` is set) and closes it in :meth:`close`.
    ``runtime=`` hands it one that the caller opened (and closes): its bus, its
    topics and its settings, the signing key among them. ``bus=`` and ``topics=``
    are for a bus of the caller's own (Kafka or custom); the key then comes from
    ``config.signing_key`` only. ``connect=False``: no bus at all, the local
    protections only.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        run_id: str | None = None,
        config: GuardConfig | None = None,
        runtime: Runtime | None = None,
        bus: Any = None,
        topics: Topics | None = None,
        scaler: Any = None,
        process_group: Any = None,
        connect: bool = True,
        preset: str | None = None,
        policy: dict[str, Any] | None = None,
        mode: GuardMode | str | None = None,
        resume: ResumeMode | str | bool | None = None,
        **options: Any,
    ) -> None:
        if options:  # a setting given where GuardConfig takes it
            raise guard_options_error(options, set(GuardConfig.model_fields))
        if runtime is not None and (bus is not None or topics is not None):
            given = " and ".join(
                name for name, v in (("bus", bus), ("topics", topics)) if v is not None
            )
            raise TypeError(
                f"Guard got both runtime= and {given}=: a runtime brings its own bus, topics "
                "and signing key; pass runtime= alone, or bus= and topics= for a bus of your own"
            )
        self.sharded = model_is_sharded(model)  # FSDP2 / DTensor (sharded.py); FSDP1 refused, first
        self.model, self.optimizer, self.scheduler, self.scaler = (
            model,
            optimizer,
            scheduler,
            scaler,
        )
        self.run_id = (
            run_id or os.environ.get("SPIKEGUARD_RUN_ID") or f"run-{uuid.uuid4().hex[:12]}"
        )
        self.sync = RankSync(process_group)
        self.rank = self.sync.rank
        # This run's session: in every record it publishes, and every action it takes must name it.
        self.session: str = self.sync.share(new_session())
        self._own_runtime: Runtime | None = None  # opened here, so closed here
        if (
            runtime is None
            and bus is None
            and connect
            and (self.rank == 0 or (config is not None and config.publish_all_ranks))
        ):
            from spikeguard.runtime import open_runtime  # embedded pipeline, or Kafka

            runtime = self._own_runtime = open_runtime()
        settings = None
        if runtime is not None:
            bus, topics, settings = runtime.bus, topics or runtime.topics, runtime.settings
        cfg = config or getattr(settings, "guard", None) or GuardConfig()
        given = {k: v for k, v in (("mode", mode), ("resume", resume)) if v is not None}
        if given:  # the arguments win over the config (validated as the config's own fields)
            checked = GuardConfig.model_validate(given)
            cfg = cfg.model_copy(update={k: getattr(checked, k) for k in given})
        # The run's preset and policy, checked against the checkpoint settings (run_plan.py).
        self.plan = make_plan(cfg, preset, policy)
        self.config = cfg = self.plan.config
        directory = Path(cfg.checkpoint_dir or Path("spikeguard-checkpoints") / self.run_id)
        self.store = CheckpointStore(directory, self.run_id, cfg.keep_checkpoints, self.rank)
        # torch.save off the training thread; a sharded model's DCP save is collective: on this one.
        self.saver = AsyncSaver(self.store, cfg.async_checkpoint and not self.sharded)
        self.io_faults = IOFaults(self.run_id)  # its own writes fail without ending the run
        self.ledger = ActionLedger(directory / SIDECAR, cfg.max_applied_ids, self.io_faults)
        # The one signer of this Guard's records and checker of its actions: the Guard's own
        # config's key, else its runtime's. A bus handed alone carries no key.
        self.signer = Signer(cfg.signing_key or (settings.keys() if settings is not None else None))
        if bus is not None and settings is None and self.signer.key is None:
            log.warning(
                "spikeguard: run %s was handed a bus without a signing key (GuardConfig."
                "signing_key): its steps go out unsigned, so a pipeline that checks signatures "
                "(every embedded runtime's, Kafka workers with a key) refuses them to the DLQ, and "
                "it obeys unsigned actions. Hand an embedded runtime as Guard(..., runtime="
                "runtime), or give the Guard the pipeline's key in GuardConfig(signing_key=...)",
                self.run_id,
            )
        self.actions = ActionQueue(self.ledger, self.signer)
        self.handlers: dict[ActionKind, Handler] = {}
        self.signals: Any = None  # opt-in mechanism signals (producers/signals/prevention.py)
        self.stats = GradStats(list(model.named_parameters()), cfg.top_k_layers, cfg.param_norm)
        self.updates = UpdateNorm(
            list(model.parameters()), cfg.update_norm
        )  # normed at the next step
        self.clipper = GradClipper(cfg.clip_beta, cfg.clip_warmup, cfg.clip_track_z)
        if (
            cfg.max_grad_norm is not None
        ):  # the Guard clips after measuring: the true norm is published
            self.clipper.set_fixed(cfg.max_grad_norm)
        self.lr = LRControl(optimizer)
        self.torch_optimizer = torch_optimizer(optimizer, required=False)  # the one a scaler steps
        self.usage = StepWatch(self.torch_optimizer)  # two updates for one batch (misuse.py)
        self._said_no_data = False
        self.amp = ScalerControl(scaler)
        self.health = HealthTracker(cfg.incident_window, cfg.healthy_stretch)
        self.position = DataPosition(cfg.history_steps)
        self.incidents = IncidentRecorder(
            directory,
            self.run_id,
            cfg.provenance_window,  # forensics
            faults=self.io_faults,
        )
        self.rerun = RerunCheck(cfg.verify_reruns)
        # The local outlier model always scores (it backs decisions: evidence.py); it skips
        # only with skip_outliers.
        self.skip_rule = SkipRule(max_run=cfg.skip_max_run)
        # Everything a checkpoint holds and a rollback puts back, in load order.
        weights = (
            [("sharded", ShardedState(model, optimizer))]
            if self.sharded  # every rank its shards
            else [("model", ModelPart(model)), ("optimizer", optimizer)]
        )
        self.parts = StateParts(
            [
                *weights,
                ("scheduler", scheduler),
                ("scaler", scaler),
                ("rng", RNGPart()),
                ("lr", self.lr),
                ("clip", self.clipper),
                ("health", self.health),
                ("ledger", self.ledger),
                ("skip_rule", self.skip_rule),
                ("data", self.position),
            ],
            per_rank=("rng", "sharded"),
        )
        self.data_seed = cfg.data_seed  # None: the loader's own draws, as unguarded (data.py)
        #: The step the next ``step()`` call is: goes back on a rollback (see ``on_rollback``).
        self.step_count = 0
        #: The rollback generation: rollbacks applied so far (``epoch`` on the wire).
        self.generation = 0
        self.mode = cfg.mode
        self.narrator = Narrator(self.run_id, loggers_from(cfg.loggers))
        self.budget = RecoveryBudget(
            cfg.max_skip_share, cfg.max_rerun_share, cfg.recovery_min_steps
        )
        self._rollback_listeners: list[Callable[[int, int], None]] = []
        self._refused_decisions: OrderedDict[str, str] = (
            OrderedDict()
        )  # decision -> why not applied
        self._outlier_note = "an isolated outlier step"  # the skip rule's words for the last one
        self.should_stop, self.stop_reason = False, None
        self.max_steps: int | None = None
        #: What the Guard did, counted (read it any time; ``summary()`` puts it in words):
        #: steps (step calls, re-run ones included), updates (applied), skipped_updates (updates
        #: the Guard skipped itself: non-finite, outlier, transient) and skipped_update_batches
        #: (their micro-batches, with gradient accumulation), rollbacks, checkpoints,
        #: actions_applied, acks, skipped_steps and skipped_batches (data skipped by skip
        #: windows, in steps and in micro-batches), scaler_skips (a GradScaler's own
        #: overflows), outlier_skips (outlier steps found), transient_steps (steps a re-run
        #: found different), actions_applied (actions that change the run, as the summary's
        #: "actions applied"), notices_applied (alerts and requested checkpoints: they change
        #: nothing), actions_withheld (not applied: mode or recovery budget).
        self.counters = dict(
            steps=0,
            updates=0,
            skipped_updates=0,
            skipped_update_batches=0,
            rollbacks=0,
            checkpoints=0,
            actions_applied=0,
            acks=0,
            skipped_batches=0,
            skipped_steps=0,
            scaler_skips=0,
            outlier_skips=0,
            transient_steps=0,
            actions_withheld=0,
            notices_applied=0,
        )
        self.resumed_from: CheckpointInfo | None = None
        self._half: FirstHalf | None = None  # between before_update and after_update
        self._started = False
        self._batch_seen = False
        self._closed = False
        self.finished = False  # see lifecycle.py: a finished run is never resumed
        self.bus, self.topics = bus, topics or Topics()
        self.publisher = self.inbox = self.waiter = None
        watch: ProtectionWatch | None = None  # (how far the pipeline has judged: rank 0's inbox)
        if bus is not None:
            t = self.topics
            bus.create_topics([t.steps, t.acks, t.checkpoints, t.actions, t.decisions])
            bus.create_topics([t.runs], compacted=True)
            self.publisher = BackgroundPublisher(
                bus.producer(),
                self.run_id,
                cfg.queue_size,
                threaded=not cfg.lockstep,
                signing_key=self.signer.key,
            )
            if self.rank == 0:
                # Does the pipeline judge this run? Said once if not (producers/protection.py).
                publisher = self.publisher
                refusals = RefusalWatch(bus, t, self.run_id, self.session)
                watch = ProtectionWatch(
                    self.run_id,
                    self.signer,
                    session=self.session,
                    send_failures=lambda: publisher.failed,
                    refusals=refusals,
                    timeout_s=cfg.unprotected_after_s,
                    published=lambda: (self.generation, self.step_count - 1),
                )
                self.inbox = ActionInbox(
                    bus,
                    t,
                    self.run_id,
                    0,
                    threaded=not cfg.lockstep,
                    protection=watch,
                    session=self.session,
                    refusals=refusals,
                )
                if cfg.lockstep:
                    self.waiter = DecisionWaiter(
                        bus, t, self.run_id, cfg.lockstep_timeout, self.signer
                    )
        self.events = RunEvents(
            self.publisher,
            self.topics,
            self.run_id,
            self.rank,
            cfg.publish_all_ranks,
            self.session,
        )
        self.acks = Acknowledgements(self, self.events)
        self.applied = self.acks.applied  # every ack: what was done, newest last
        self.checkpoints = CheckpointKeeper(
            self,
            saver=self.saver,
            parts=self.parts,
            ledger=self.ledger,
            position=self.position,
            lr=self.lr,
            clipper=self.clipper,
            health=self.health,
            incidents=self.incidents,
            events=self.events,
            io_faults=self.io_faults,
            sync=self.sync,
            config=cfg,
            sharded=self.sharded,
            ack=self.acks.send,
            judged=None if watch is None else (lambda: watch.judged),
            min_rollback_steps=self.plan.min_rollback_steps,
        )
        self.applier = ActionApplier(
            self,
            actions=self.actions,
            ledger=self.ledger,
            inbox=self.inbox,
            waiter=self.waiter,
            sync=self.sync,
            health=self.health,
            checkpoints=self.checkpoints,
            acks=self.acks,
            gate=Gate(self._weigh_plans, self._withhold_reason, self._apply_one),
        )
        self.resume(cfg.resume)

    # -- the user's API ------------------------------------------------------
    def data(
        self,
        loader: Any,
        epochs: int | None = None,
        max_steps: int | None = None,
        sample_ids: Callable[[Any], list] | None = None,
        skip_ids: SkipIds | None = None,
    ) -> GuardedLoader:
        """``loader`` wrapped: global batch index, resume after rollback, skips, fixed order.

        ``max_steps`` is the run's length in optimizer steps: the Guard stops there, and reads
        the data again from its start (the next data epoch) rather than end early, as when skip
        windows used some of it up. Without ``max_steps`` and ``epochs`` it is one pass.

        ``sample_ids(batch)`` names the samples of a batch for incident forensics; by default
        a map-style loader's dataset indices are recorded (forensics/provenance.py).
        ``skip_ids`` (``spikeguard inspect``'s report, a JSON list, or ids) are left out of
        every pass (producers/skip_samples.py).
        """
        self.max_steps = max_steps if max_steps is not None else self.max_steps
        if self.loader is None or self.loader.loader is not loader:
            if skip_ids is not None:
                leave_out(loader, skip_ids)
            self.incidents.attach(loader, sample_ids)
            self.position.attach(
                GuardedLoader(
                    loader,
                    seed=self.data_seed,
                    epochs=epochs,
                    stop_when=self._done,
                    before_batch=self._start,
                    on_batch=self._batch_read,
                    on_open=self.incidents.restart,
                )
            )
        elif epochs is not None:
            self.loader.epochs = epochs
        # With the run's length known, the data is read again rather than the run cut short.
        self.loader.until_stopped = self.max_steps is not None
        return self.loader

    @property
    def epoch(self) -> int:
        """The rollback generation under its wire name (events' ``epoch``); not a data epoch."""
        return self.generation

    @property
    def loader(self) -> GuardedLoader | None:
        return self.position.loader

    def on(self, kind: ActionKind | str, handler: Handler) -> None:
        """Register ``handler(action, guard) -> result text`` for an action kind."""
        self.handlers[ActionKind(kind)] = handler

    def step(
        self,
        loss: torch.Tensor | float,
        batch: Any = None,
        closure: Callable[[], torch.Tensor] | None = None,
    ) -> bool:
        """Replaces ``optimizer.step()`` (and ``scheduler.step()``); True when the update was applied.

        With gradient accumulation call it once per optimizer step, after the last
        micro-batch's backward, with the loss averaged over the micro-batches.
        ``closure`` recomputes this step's loss and calls backward (as for
        ``optimizer.step(closure)``); with ``verify_reruns=1`` a suspicious step is re-run with it.

        It is the two halves a framework's callback calls around the framework's own
        optimizer and scheduler step: ``before_update``, the update, ``after_update``.
        """
        check_loss(loss)
        self.usage.before_step(loss, self.loader)
        if self.loader is None and not self._said_no_data:
            self._said_no_data = True
            log.warning(
                "spikeguard: run %s: guard.data(loader) was not called, so the Guard does not "
                "know which batches each step reads and cannot skip bad data; a rollback "
                "restores the weights and the loop reads on. Iterate `for batch in "
                "guard.data(loader)` to let it skip",
                self.run_id,
            )
        if self.before_update(loss, batch, closure):
            self.amp.step(self.lr.step, self.optimizer)  # the Guard's LR factor, the scaler's step
        if self.scheduler is not None and not self.interrupted:
            self.scheduler.step()
        result = self.after_update().updated
        self.usage.after_step()
        return result

    def before_update(
        self,
        loss: torch.Tensor | float,
        batch: Any = None,
        closure: Callable[[], torch.Tensor] | None = None,
        *,
        step: int | None = None,
    ) -> bool:
        """The first half of a step: after the backward, before the optimizer's step.

        The statistics (one device-to-host transfer, unscaled under a GradScaler, shared
        across ranks), the actions due at this step, the local skip rule and clipping.
        Returns whether the update may be applied; when not, every gradient is ``None``
        and the coming ``optimizer.step()`` changes nothing (update.py). ``step`` is a
        framework's own step number (default: the Guard's count).
        """
        check_loss(loss)
        self._start()
        if step is not None:
            self.step_count = step
        step = self.step_count
        self.applier.collect(step)
        due = self.actions.due(step) if self.rank == 0 else []
        self.amp.begin(
            self.torch_optimizer
        )  # statistics and clipping are about the unscaled gradients
        stats, grads = self.stats.compute(
            loss, batch, self._riders(bool(due)), self.updates.last_update(step, self.generation)
        )
        if self.sync.enabled:  # the run's loss (the largest rank's) is what is judged and published
            stats = across_ranks(stats, self.sync.world_size)
        shared = stats.riders
        loss_scale = self.amp.scale()
        # Under a GradScaler an inf/NaN gradient with a finite loss is the scaler's own business.
        overflow = self.amp.enabled and math.isfinite(stats.loss) and not stats.finite
        if self.sync.enabled:
            nonfinite = shared["any_nonfinite"] > 0
        else:
            nonfinite = not math.isfinite(stats.loss) if self.amp.enabled else not stats.finite
        interrupted = False
        if shared["any_due"] > 0 if self.sync.enabled else bool(due):
            if self.sync.enabled:
                sent = [a.model_dump(mode="json") for a in due] if self.rank == 0 else None
                due = [Action.model_validate(d) for d in self.sync.broadcast(sent)]
            interrupted = self.applier.apply(
                due, step
            )  # rolled back or stopped: this step's update is void
        reason: str | None = None
        scored, rerun = None, None
        if interrupted:
            reason = INTERRUPTED
        elif self._data_skipped():
            reason = SKIPPED_DATA
        else:
            reason = "non_finite" if nonfinite and self.config.skip_nonfinite else None
            judged = None
            if reason is None and not overflow:
                judged = self._judge_outlier(stats)
                reason = "outlier_step" if self._skips(judged) else None
            if (
                reason is not None
                and self.rerun.enabled
                and self.mode is not GuardMode.OBSERVE
                and not (self.sync.enabled or self.amp.enabled)
            ):
                # (one rank's re-run would split the ranks; a scaler's re-run gradients come scaled)
                params = [p for p in self.model.parameters() if p.requires_grad]
                stats, rerun = self.rerun.judge(closure, params, stats)
                if rerun == "transient":
                    # The re-run recomputed the same batch on the same weights: when its own values
                    # are clean, its gradient is the step's true one and its update is applied.
                    self.counters["transient_steps"] += 1
                    nonfinite = not stats.finite
                    judged = None if nonfinite else self._judge_outlier(stats)
                    reason = "transient" if nonfinite or self._skips(judged) else None
                    grads = self.stats.clip_targets()  # the re-run's gradients, not the fault's
            if judged is not None:  # what is learned is what is published: a re-run's values
                self.skip_rule.learn(judged)
                scored = judged.decision
                if reason == "outlier_step":
                    self._found_outlier(judged.decision)
            reason = self._local_skip(step, reason, stats)
            if reason is not None:
                self.counters["skipped_updates"] += 1
        if reason is not None:
            self._void_update(interrupted)
            self.updates.skipped(step, self.generation)
        else:
            if stats.grad_norm is not None and not overflow:
                self.clipper.clip(grads, stats.grad_norm)
            self.updates.before_update(
                step, self.generation, applies=not overflow
            )  # an overflow skip: 0
            if overflow:  # the scaler skips this update itself
                reason = "scaler_overflow"
                self.counters["scaler_skips"] += 1
            else:
                self.counters["updates"] += 1
            if stats.grad_norm is not None:
                self.clipper.observe(stats.grad_norm)
        if self.signals is not None:
            self.signals.before_update()
        self._half = FirstHalf(
            step, stats, reason, nonfinite, overflow, scored, rerun, loss_scale, self.lr.effective()
        )
        return reason in (None, "scaler_overflow")

    @property
    def interrupted(self) -> bool:
        """A rollback or stop was applied in this step's first half: its update (and, for the
        Guard's own step, its scheduler step) does not happen."""
        return self._half is not None and self._half.reason == INTERRUPTED

    def after_update(self) -> StepResult:
        """The second half of a step: after the optimizer's (and the scheduler's) step.

        The StepEvent, the step's bookkeeping, checkpoints due, acks. Without a first half
        (a framework's micro-batch of an accumulation) it does nothing.
        """
        half, self._half = self._half, None
        if half is None:
            return StepResult(False, False)
        self.updates.after_update()  # the update the optimizer just made, if the first half allowed it
        measured = self.signals.after_update() if self.signals is not None else {}
        step, stats, reason = half.step, half.stats, half.reason
        if reason == INTERRUPTED:
            self._interrupted_step_done(step)
            self.checkpoints.save_if_due(requests_only=True)
            self.checkpoints.drain()
            self.applier.finish()
            return StepResult(False, True)
        if reason in (None, "scaler_overflow"):
            self.amp.count(half.overflow)
        if reason != SKIPPED_DATA:  # (a step whose data a skip window covers is not published)
            self.events.step(
                step,
                self.generation,
                stats,
                lr=half.lr,
                reason=reason,
                loss_scale=half.loss_scale,
                overflow_streak=self.amp.streak,
                batch_index=self.loader.last_index if self.loader is not None else None,
                rerun=half.rerun,
                outlier=half.scored is not None and half.scored.skip,
                signals=measured,
            )
            self.actions.published.remember(
                self.generation,
                step,
                stats.loss,  # checked against action evidence
                None if reason == "scaler_overflow" else stats.grad_norm,
                own_view(
                    half.nonfinite, half.overflow, half.scored, bool(measured) and self.signals.over
                ),
            )
            self.health.observe(
                step, not (half.nonfinite or reason in ("outlier_step", "transient"))
            )  # a local onset
        batches = self.position.record(step)  # micro-batches this step read (accumulation)
        self.incidents.step(step)
        self._batch_seen = False
        self.rerun.before_step()  # the next forward's random streams (again at its first batch)
        if reason in ("non_finite", "outlier_step", "transient"):
            self.counters["skipped_update_batches"] += batches
        self.step_count = step + 1
        self.counters["steps"] += 1
        self.checkpoints.save_if_due()
        self.checkpoints.drain()
        self.applier.finish()
        if self.waiter is not None and reason != SKIPPED_DATA:
            self.waiter.follow(self.inbox, self.generation, step, self.config.lockstep_settle)
        return StepResult(reason is None, False)

    def close(self, finished: bool | None = None) -> RunSummary:
        """Flush everything; ``finished`` (default: the planned steps ran, or the data ran out).

        Logs the run's summary (one paragraph, WARNING) and returns it; see ``summary()``.
        """
        if self._closed:
            return self.summary()
        self._closed = True
        self.usage.close()
        self.saver.close()
        self.checkpoints.drain()
        if finished is None:
            planned = self.max_steps is not None and self.step_count >= self.max_steps
            ran_out = self.loader is not None and self.loader.ran_out
            finished = not self.should_stop and (planned or ran_out)
        self.finished = self.finished or finished
        self.checkpoints.persist_ledger()
        if self._started:
            self.events.run(
                "end",
                self.plan,
                self.max_steps,
                self.step_count,
                self.generation,
                self.finished,
                self.stop_reason or ("finished" if self.finished else "closed"),
            )
        for part in (self.waiter, self.inbox):
            if part is not None:
                part.close()
        if self.publisher is not None:
            self.publisher.close(self.config.flush_timeout)
        if self._own_runtime is not None:
            self._own_runtime.close()
        self.narrator.repeats.end()  # the counts of lines said once and then counted
        summary = self.summary()
        log.warning("%s", summary)
        return summary

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.close(finished=False if exc_type is not None else None)

    # -- state: a dict of parts ------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every part's state (this rank's parts only, on ranks other than 0)."""
        return self.parts.state_dict(self.rank)

    def load_state_dict(self, body: dict[str, Any]) -> None:
        """Load every part; applied-action ids and skip ranges are merged, never replaced."""
        self.parts.load_state_dict(body, self.rank)

    def rollback(
        self, target_step: int, checkpoint_id: str | None = None, onset_step: int | None = None
    ) -> str:
        """Every rank calls it at the same step; rank 0 chooses the checkpoint, every rank loads
        that one (or, when a rank cannot read it, all the next older healthy one), or all fail.
        ``onset_step``: the incident's onset, for when the target has rotated out
        (CheckpointKeeper.rollback_candidates)."""
        self.saver.wait()  # the checkpoint it needs may still be being written
        self.checkpoints.drain()
        # Rank 0 chooses once its own saves are on disk (waited for above); the rest follow.
        candidates, note = self.checkpoints.agreed_rollback_candidates(
            target_step, checkpoint_id, onset_step
        )
        loaded = self.checkpoints.load_agreed(candidates)
        info = loaded.info
        if loaded.passed:
            note += f" (passed over {'; '.join(loaded.passed)})"
        if info is None:
            raise ActionFailed(
                f"no checkpoint at or before step {target_step} to roll back to{note}"
            )
        from_step = self.step_count
        self.generation += 1
        self.step_count = info.step
        self.should_stop = False
        self.position.rewind(info.step)
        self.counters["rollbacks"] += 1
        self._rolled_back(from_step, info.step)
        return f"rolled back to step {info.step} ({info.checkpoint_id}), now epoch {self.generation}{note}"

    def skip_steps(
        self, from_step: int, to_step: int, extra: int = 0, after_rollback: bool = False
    ) -> str:
        start, end, steps = self.position.skip_steps(from_step, to_step, extra, after_rollback)
        self.counters["skipped_batches"] += end - start + 1
        self.counters["skipped_steps"] += steps
        text = f"skipping batches {start}..{end}"
        if end - start + 1 != steps:  # gradient accumulation: say both
            text += f" ({end - start + 1} micro-batches, {steps} optimizer steps)"
        ends = getattr(self.loader, "data_end", None)  # (a framework's stream has no end it knows)
        data_end = ends() if ends is not None else None
        if data_end is not None and end >= data_end:
            log.warning(
                "spikeguard: the skip window %d..%d reaches past the end of the data (its last "
                "batch is %d): this pass ends %d batches early; guard.data(loader, max_steps=N) "
                "reads the data again to reach N steps instead",
                start,
                end,
                data_end - 1,
                min(end, data_end - 1) - max(start, self.loader.position) + 1,
            )
        return text

    def resume(self, mode: ResumeMode | str = ResumeMode.AUTO) -> CheckpointInfo | None:
        """Continue from the newest checkpoint of this run, as ``mode`` says (config.ResumeMode).

        ``auto``: an unfinished run is resumed (the ledger always applies), a finished one is
        moved aside and started again; ``must``: resume or raise ConfigError; ``never``: earlier
        files are moved aside and the run starts from step 0 (checkpointing.py). Returns the
        checkpoint resumed from (None: none).
        """
        info = self.checkpoints.resume(mode)
        if info is not None:
            self.resumed_from = info  # (its checkpoint is on disk: _start saves no initial one)
        return info

    def checkpoint(self, reason: str = "on_demand") -> CheckpointEvent:
        """Save now (state before step ``step_count``), wait until it is on disk, publish it.

        ``reason="final"`` also marks the run finished: it will not be resumed.
        (Periodic and requested checkpoints do not wait: see async_checkpoint.py.)
        """
        return self.checkpoints.checkpoint(reason)

    # -- what actions call ---------------------------------------------------
    def request_checkpoint(self, action: Action, reason: str) -> None:
        self.checkpoints.request(action, reason)

    def request_stop(self, reason: str) -> None:
        self.should_stop, self.stop_reason = True, reason

    # -- internals ------------------------------------------------------------
    def _done(self) -> bool:
        return self.should_stop or (
            self.max_steps is not None and self.step_count >= self.max_steps
        )

    def _batch_read(self, batch: Any, used: bool) -> None:
        self.incidents.batch(batch, used)
        if used and not self._batch_seen:  # reading a batch may draw from the global RNG: after it
            self._batch_seen = True
            self.rerun.before_step()

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self.events.run(
                "start",
                self.plan,
                self.max_steps,
                self.step_count,
                self.generation,
                False,
                "resumed" if self.resumed_from is not None else "new",
            )
            if self.resumed_from is not None and self.rank == 0:
                # A new session starts the run afresh in the pipeline: it learns the rollback
                # targets this run resumes with from this session, not from the one before.
                for info in reversed(self.store.list()):
                    self.events.checkpoint(
                        CheckpointEvent(
                            run_id=self.run_id,
                            step=info.step,
                            epoch=info.epoch,
                            checkpoint_id=info.checkpoint_id,
                            path=str(info.path),
                            healthy=info.healthy,
                        ),
                        [],
                    )
            # A rollback target before anything can go wrong, on every rank or on none: rank 0
            # decides (a rank that starts late would find rank 0's checkpoint and skip its own).
            if self.sync.share(self.store.newest() is None and self.saver.in_flight is None):
                self.checkpoints.save("periodic")

    def _riders(self, due: bool):
        """The ranks' flags and losses, gathered on device, ride along with the statistics' one transfer."""
        if not self.sync.enabled:
            return None
        if self.amp.enabled:  # an inf gradient is the scaler's overflow; only the loss counts here
            return lambda bad, loss, norm: self.sync.flags(
                (~torch.isfinite(loss)).float(), due, loss, norm
            )
        return lambda bad, loss, norm: self.sync.flags(bad, due, loss, norm)

    def _judge_outlier(self, stats: Any) -> StepJudged:
        """The local outlier model's judgement (not yet learned), on values every rank shares
        (the largest of any rank)."""
        r = stats.riders
        loss, grad = (
            (r["max_loss"], r["max_grad_norm"])
            if self.sync.enabled
            else (stats.loss, stats.grad_norm)
        )
        return self.skip_rule.judge(
            loss, None if grad is None or grad < 0 else grad, self.lr.effective()
        )

    def _skips(self, judged: StepJudged | None) -> bool:
        """Whether the local rule skips a judged step (it always scores; it skips with skip_outliers)."""
        return judged is not None and judged.decision.skip and self.config.skip_outliers

    def _found_outlier(self, decision: SkipDecision) -> None:
        self.counters["outlier_skips"] += 1
        # The rule's measure is the residual over its threshold (1.0 at the threshold): said as
        # a multiple of the threshold, so that 1.1 does not read as an ordinary 1.1 sigma.
        self._outlier_note = (
            f"{decision.signal} outlier (loss at {_over(decision.loss_z)} its outlier threshold, "
            f"grad norm at {_over(decision.grad_z)})"
        )

    def _void_update(self, interrupted: bool) -> None:
        """This step's update does not happen: every gradient None, the scaler's scale kept."""
        void_update(self.optimizer)
        self.amp.void()

    def _data_skipped(self) -> bool:
        """Whether this step read data a skip window covers (the Guard's loader never yields it)."""
        return False

    def _interrupted_step_done(self, step: int) -> None:
        """The Guard's own step that a rollback or stop interrupted did not happen: nothing counts."""

    # -- what the user sees and controls: mode, budget, narration, rollback listeners -----
    def _local_skip(self, step: int, reason: str | None, stats: Any) -> str | None:
        """Say the Guard's own update skip out loud; in observe mode say it would, and do not."""
        if reason not in ("non_finite", "outlier_step", "transient"):
            return reason
        why = {
            "non_finite": f"non-finite loss (loss {stats.loss:.4g})"
            if not math.isfinite(stats.loss)
            else f"non-finite gradient (grad norm {stats.grad_norm:.4g}, loss {stats.loss:.4g})",
            "transient": "a re-run of the step came out different (a transient device fault)",
            "outlier_step": self._outlier_note,
        }[reason]
        if self.mode is GuardMode.OBSERVE:
            self.counters["actions_withheld"] += 1
            self.narrator.would_skip_update(step, why, reason)
            return None
        log.warning(
            "spikeguard: skipped the update of step %d: %s; cost: 1 update, no rollback", step, why
        )
        return reason

    def _apply_one(self, action: Action) -> Outcome | None:
        """Apply one due action, or withhold it (mode, recovery budget), saying which out loud."""
        if action.kind not in STEERING:
            return apply_action(self, action, self.step_count)
        because = self._withhold_reason(action)
        if because is not None:
            self.counters["actions_withheld"] += 1
            self.narrator.withhold(action, would_do(action), because, self.step_count)
            return Outcome(action, AckStatus.REJECTED, self.step_count, f"{WITHHELD}{because}")
        before = self._cost()
        outcome = apply_action(self, action, self.step_count)
        if outcome is not None and outcome.status is AckStatus.APPLIED:
            self.narrator.took(action, outcome.result, before, self._cost())
        return outcome

    def _withhold_reason(self, action: Action) -> str | None:
        if self.mode is GuardMode.OBSERVE:
            return "observe mode"
        if self.mode is GuardMode.SKIP_ONLY:
            return "skip-only mode (only the Guard's own update skips are taken)"
        if (
            action.kind is ActionKind.STOP
            and action.decision_id is not None
            and self._refused_decisions
        ):
            # Past the budget the Guard alerts and asks: ending the run is a person's call then
            # (an operator's `spikeguard stop` has no decision and still applies).
            return "the recovery budget is spent: stopping the run is left to a person (spikeguard stop)"
        if action.kind is ActionKind.SKIP_BATCHES and self.loader is None:
            return (
                "there is no guard.data(loader), so the Guard cannot skip batches; the loop reads "
                "on, and the batches of those steps are not read again"
            )
        # weighed whole, by decision (an action of no decision alone): _weigh_plans
        return self._refused_decisions.get(action.decision_id or action.action_id)

    def _weigh_plans(self, due: list[Action]) -> None:
        """Weigh each decision's plan whole against the recovery budget before any of it is applied:
        a rollback must not go ahead when the skip window that comes with it is refused.

        With several ranks, rank 0 weighs (it alone holds the plans' actions not due yet) with
        the run's length all ranks agree on, and every rank withholds what it refused; when
        weighing fails there, every rank withholds the plans due."""
        if self.mode is not GuardMode.PROTECT:
            return
        plans = dict.fromkeys(
            a.decision_id or a.action_id
            for a in due
            if a.decision_id is not None or a.kind in STEERING
        )
        planned = self.sync.least(self.planned_steps())
        try:
            refused = self.sync.decide(lambda: self._refusals(list(plans), due, planned))
        except RanksFailed as exc:
            refused = {p: f"the recovery budget could not be weighed: {exc}" for p in plans}
        self._refused_decisions.update(refused)
        while len(self._refused_decisions) > 1000:
            self._refused_decisions.popitem(last=False)

    def _refusals(self, plans: list[str], due: list[Action], planned: int) -> dict[str, str]:
        """Why each of ``plans`` (a decision id, or an action id) is refused; those that fit: absent."""
        refused = {}
        for key in plans:
            if key in self._refused_decisions:
                continue
            plan = [
                a for a in (*due, *self.actions.pending) if (a.decision_id or a.action_id) == key
            ]
            because = self._over_budget(plan, planned)
            if because is not None:
                refused[key] = f"its plan is {because}"
        return refused

    def _over_budget(self, plan: list[Action], planned: int | None = None) -> str | None:
        asked = [
            self._asked(a) for a in plan if a.kind in STEERING and a.action_id not in self.ledger
        ]
        total = Spend(sum(s.rerun_steps for s in asked), sum(s.skip_steps for s in asked))
        return self.budget.refusal(
            total,
            Spend(self.narrator.rerun_steps, self.counters["skipped_steps"]),
            self.planned_steps() if planned is None else planned,
        )

    def _asked(self, action: Action) -> Spend:
        """What a rollback or skip window would cost, in steps, before it is applied."""
        p = action.params
        if action.kind is ActionKind.ROLLBACK:
            info = self.store.newest_healthy(max_step=p.target_step)
            return Spend(max(self.step_count - (info.step if info else p.target_step), 0), 0)
        if action.kind is ActionKind.SKIP_BATCHES:
            return Spend(0, max(p.to_step - p.from_step + 1, 0) + p.extra)
        return Spend(0, 0)

    def _cost(self) -> Cost:
        c = self.counters
        return Cost(
            self.step_count,
            self.narrator.rerun_steps,
            c["skipped_batches"],
            c["skipped_steps"],
            self.lr.effective(),
        )

    def planned_steps(self) -> int:
        """The run's length for the recovery budget: max_steps, else what the loader holds, else the
        steps run so far."""
        if self.max_steps is not None:
            return self.max_steps
        loader = self.loader
        batches = getattr(loader, "batches_per_epoch", None)  # (a framework's stream has no length)
        if batches:
            spans = list(self.position.spans.values())
            per_step = sum(b - a + 1 for a, b in spans) / len(spans) if spans else 1.0
            return int(batches * (loader.epochs or 1) / max(per_step, 1.0))
        return self.counters["steps"]

    def on_rollback(self, listener: Callable[[int, int], None]) -> None:
        """Call ``listener(from_step, to_step)`` after every rollback, once the state is restored.

        ``from_step`` is the step that was about to run, ``to_step`` the step the run goes on
        from (``guard.step_count``). A loop that keeps its own counter, or does something every
        N steps, follows the Guard here. A listener that raises is logged, never fatal.
        """
        self._rollback_listeners.append(listener)

    def _rolled_back(self, from_step: int, to_step: int) -> None:
        for listener in self._rollback_listeners:
            try:
                listener(from_step, to_step)
            except Exception:  # noqa: BLE001 - the user's listener must not kill training
                log.exception("spikeguard: on_rollback listener %r raised", listener)

    def summary(self) -> RunSummary:
        """The run so far: incidents, actions taken and withheld, and the goodput."""
        c, n = self.counters, self.narrator
        return RunSummary(
            self.run_id,
            self.mode.value,
            self.step_count,
            c["steps"],
            n.rerun_steps,
            c["skipped_batches"],
            c["skipped_steps"],
            c["skipped_updates"],
            len(n.incidents),
            dict(n.applied),
            dict(n.withheld),
            self.lr.scale,
            dict(self.acks.notices),
            _recovery_clip(self.clipper, self.config.max_grad_norm),
        )


def _recovery_clip(clipper: GradClipper, own: float | None) -> str:
    """The clipping CLIP actions set beyond the user's own max_grad_norm ("": none)."""
    bounds = []
    if clipper.max_norm is not None and clipper.max_norm != own:
        bounds.append(f"max_norm {clipper.max_norm:g}")
    if clipper.z is not None:
        bounds.append(f"{clipper.z:g} deviations above the mean norm (adaptive)")
    return " and ".join(bounds)


def _over(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"
