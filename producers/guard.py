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
import os
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from spikeguard.producers.actions import ActionQueue, Handler
from spikeguard.producers.amp import ScalerControl
from spikeguard.producers.applying import Acknowledgements, ActionApplier
from spikeguard.producers.async_checkpoint import AsyncSaver
from spikeguard.producers.budget import RecoveryBudget
from spikeguard.producers.checkpointing import CheckpointKeeper
from spikeguard.producers.checkpoints import CheckpointInfo, CheckpointStore
from spikeguard.producers.clipping import GradClipper
from spikeguard.producers.config import GuardConfig, GuardMode, ResumeMode
from spikeguard.producers.connection import open_links, warn_unsigned
from spikeguard.producers.data import GuardedLoader
from spikeguard.producers.distributed import RankSync
from spikeguard.producers.health import HealthTracker
from spikeguard.producers.incidents import IncidentRecorder
from spikeguard.producers.io_faults import IOFaults
from spikeguard.producers.ledger import SIDECAR, ActionLedger
from spikeguard.producers.lr import LRControl
from spikeguard.producers.misuse import StepWatch, check_loss, guard_options_error
from spikeguard.producers.narration import Narrator, RunSummary
from spikeguard.producers.parts import BatchSource, DataPosition, ModelPart, RNGPart, StateParts
from spikeguard.producers.rerun import RerunCheck
from spikeguard.producers.run_events import RunEvents
from spikeguard.producers.run_plan import make_plan
from spikeguard.producers.run_state import Counters, RunState
from spikeguard.producers.sharded import ShardedState, model_is_sharded
from spikeguard.producers.skip_rule import SkipRule
from spikeguard.producers.skip_samples import SkipIds, leave_out
from spikeguard.producers.stats import GradStats
from spikeguard.producers.step_halves import OwnLoop, StepHalves, StepResult
from spikeguard.producers.steering import Steering
from spikeguard.producers.update import torch_optimizer
from spikeguard.producers.update_norm import UpdateNorm
from spikeguard.producers.wiring import WIRING, PipelineRuntime, action_loggers
from spikeguard.schemas import Action, ActionKind, CheckpointEvent, Topics, new_session
from spikeguard.schemas.signing import Signer

__all__ = ["Guard", "StepResult"]

log = logging.getLogger(__name__)


def _run_field(name: str, doc: str) -> Any:
    """A field of the run's state under the Guard's public name of it."""
    return property(
        lambda guard: getattr(guard.state, name),
        lambda guard, value: setattr(guard.state, name, value),
        doc=doc,
    )


class Guard:
    """Guards one training run; see the module's docstring.

    Where its steps go: by default the Guard opens a runtime of its own (the embedded
    pipeline, or Kafka when ``SPIKEGUARD_BOOTSTRAP_SERVERS`` is set: spikeguard.runtime,
    through wiring.py) and closes it in :meth:`close`. ``runtime=`` hands it one that the
    caller opened (and closes): its bus, its topics and its settings, the signing key among
    them. ``bus=`` and ``topics=`` are for a bus of the caller's own (Kafka or custom); the
    key then comes from ``config.signing_key`` only. ``connect=False``: no bus at all, the
    local protections only.

    It builds its parts over one :class:`~spikeguard.producers.run_state.RunState` and owns
    them; none calls back into it: the checkpoint keeper (checkpointing.py), the action
    applier with the run's steering (applying.py, steering.py) and the step's two halves
    (step_halves.py).
    """

    step_count = _run_field("step_count", "The step the next ``step()`` call is (see on_rollback).")
    generation = _run_field("generation", "Rollbacks applied so far (``epoch`` on the wire).")
    should_stop = _run_field("should_stop", "A stop was applied: the loop should end.")
    stop_reason = _run_field("stop_reason", "Why the run stops (None: it does not).")
    max_steps = _run_field("max_steps", "The run's length in optimizer steps, when known.")
    finished = _run_field("finished", "The run is done and is never resumed (lifecycle.py).")
    resumed_from = _run_field("resumed_from", "The checkpoint resumed from (None: none).")

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        *,
        run_id: str | None = None,
        config: GuardConfig | None = None,
        runtime: PipelineRuntime | None = None,
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
            both = " and ".join(n for n, v in (("bus", bus), ("topics", topics)) if v is not None)
            raise TypeError(
                f"Guard got both runtime= and {both}=: a runtime brings its own bus, topics "
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
        self.state = run = RunState(self.run_id)
        self.sync = sync = RankSync(process_group)
        self.rank = sync.rank
        # This run's session: in every record it publishes, and every action it takes must name it.
        self.session: str = sync.share(new_session())
        self._own_runtime: PipelineRuntime | None = None  # opened here, so closed here
        publishes = self.rank == 0 or (config is not None and config.publish_all_ranks)
        if runtime is None and bus is None and connect and publishes and WIRING.open_runtime:
            runtime = self._own_runtime = WIRING.open_runtime()  # embedded pipeline, or Kafka
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
            warn_unsigned(self.run_id)
        self.actions = ActionQueue(self.ledger, self.signer)
        self.stats = GradStats(list(model.named_parameters()), cfg.top_k_layers, cfg.param_norm)
        self.updates = UpdateNorm(list(model.parameters()), cfg.update_norm)  # normed a step later
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
            cfg.provenance_window,
            faults=self.io_faults,  # forensics
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
        self.narrator = Narrator(self.run_id, action_loggers(cfg.loggers))
        self._closed = False
        self.bus, self.topics = bus, topics or Topics()
        links = open_links(
            bus,
            self.topics,
            run,
            session=self.session,
            signer=self.signer,
            config=cfg,
            rank=self.rank,
        )
        self.publisher, self.inbox, self.waiter = links.publisher, links.inbox, links.waiter
        self.events = RunEvents(
            self.publisher, self.topics, self.run_id, self.rank, cfg.publish_all_ranks, self.session
        )
        self.acks = Acknowledgements(run, self.events)
        self.applied = self.acks.applied  # every ack: what was done, newest last
        watch = links.watch
        self.checkpoints = CheckpointKeeper(
            run,
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
            sync=sync,
            config=cfg,
            sharded=self.sharded,
            ack=self.acks.send,
            judged=None if watch is None else (lambda: watch.judged),
            min_rollback_steps=self.plan.min_rollback_steps,
        )
        self.steering = Steering(
            run,
            mode=cfg.mode,
            budget=RecoveryBudget(cfg.max_skip_share, cfg.max_rerun_share, cfg.recovery_min_steps),
            narrator=self.narrator,
            lr=self.lr,
            clipper=self.clipper,
            optimizer=optimizer,
            actions=self.actions,
            ledger=self.ledger,
            checkpoints=self.checkpoints,
            position=self.position,
        )
        self.applier = ActionApplier(
            run,
            actions=self.actions,
            ledger=self.ledger,
            inbox=self.inbox,
            waiter=self.waiter,
            sync=sync,
            health=self.health,
            checkpoints=self.checkpoints,
            acks=self.acks,
            steering=self.steering,
        )
        self.halves = StepHalves(
            run,
            config=cfg,
            plan=self.plan,
            params=lambda: [p for p in model.parameters() if p.requires_grad],
            torch_optimizer=self.torch_optimizer,
            stats=self.stats,
            updates=self.updates,
            amp=self.amp,
            sync=sync,
            skip_rule=self.skip_rule,
            rerun=self.rerun,
            applier=self.applier,
            checkpoints=self.checkpoints,
            events=self.events,
            incidents=self.incidents,
            inbox=self.inbox,
            waiter=self.waiter,
            loop=OwnLoop(optimizer, self.amp),
        )
        self.resume(cfg.resume)

    # -- the run's state, read through the Guard ------------------------------------
    @property
    def counters(self) -> Counters:
        """What the Guard did, counted (run_state.Counters; ``summary()`` puts it in words)."""
        return self.state.counters

    @property
    def mode(self) -> GuardMode:
        return self.steering.mode

    @property
    def budget(self) -> RecoveryBudget:
        return self.steering.budget

    @property
    def handlers(self) -> dict[ActionKind, Handler]:
        return self.steering.handlers

    @property
    def epoch(self) -> int:
        """The rollback generation under its wire name (events' ``epoch``); not a data epoch."""
        return self.state.generation

    @property
    def loader(self) -> BatchSource | None:
        return self.position.loader

    @property
    def interrupted(self) -> bool:
        """A rollback or stop was applied in this step's first half: its update (and, for the
        Guard's own step, its scheduler step) does not happen."""
        return self.halves.interrupted

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
        self.state.max_steps = max_steps if max_steps is not None else self.state.max_steps
        guarded = self.position.loader
        if not isinstance(guarded, GuardedLoader) or guarded.loader is not loader:
            if skip_ids is not None:
                leave_out(loader, skip_ids)
            self.incidents.attach(loader, sample_ids)
            guarded = GuardedLoader(
                loader,
                seed=self.data_seed,
                epochs=epochs,
                stop_when=self.state.done,
                before_batch=self.halves.start,
                on_batch=self.halves.batch_read,
                on_open=self.incidents.restart,
            )
            self.position.attach(guarded)
        elif epochs is not None:
            guarded.epochs = epochs
        # With the run's length known, the data is read again rather than the run cut short.
        guarded.until_stopped = self.state.max_steps is not None
        return guarded

    def on(self, kind: ActionKind | str, handler: Callable[[Action, Guard], str | None]) -> None:
        """Register ``handler(action, guard) -> result text`` for an action kind."""
        self.steering.handlers[ActionKind(kind)] = lambda action, _: handler(action, self)

    def on_rollback(self, listener: Callable[[int, int], None]) -> None:
        """Call ``listener(from_step, to_step)`` after every rollback, once the state is restored.

        ``from_step`` is the step that was about to run, ``to_step`` the step the run goes on
        from (``guard.step_count``). A loop that keeps its own counter, or does something every
        N steps, follows the Guard here. A listener that raises is logged, never fatal.
        """
        self.steering.rollback_listeners.append(listener)

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
        self.halves.start()
        if step is not None:
            self.state.step_count = step
        return self.halves.before_update(loss, batch, closure)

    def after_update(self) -> StepResult:
        """The second half of a step: after the optimizer's (and the scheduler's) step.

        The StepEvent, the step's bookkeeping, checkpoints due, acks. Without a first half
        (a framework's micro-batch of an accumulation) it does nothing.
        """
        return self.halves.after_update()

    def close(self, finished: bool | None = None) -> RunSummary:
        """Flush everything; ``finished`` (default: the planned steps ran, or the data ran out).

        Logs the run's summary (one paragraph, WARNING) and returns it; see ``summary()``.
        """
        if self._closed:
            return self.summary()
        self._closed = True
        run = self.state
        self.usage.close()
        self.saver.close()
        self.checkpoints.drain()
        if finished is None:
            planned = run.max_steps is not None and run.step_count >= run.max_steps
            ran_out = self.loader is not None and self.loader.ran_out
            finished = not run.should_stop and (planned or ran_out)
        run.finished = run.finished or finished
        self.checkpoints.persist_ledger()
        if self.halves.started:
            self.events.run(
                "end",
                self.plan,
                run.max_steps,
                run.step_count,
                run.generation,
                run.finished,
                run.stop_reason or ("finished" if run.finished else "closed"),
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

    def resume(self, mode: ResumeMode | str = ResumeMode.AUTO) -> CheckpointInfo | None:
        """Continue from the newest checkpoint of this run, as ``mode`` says (config.ResumeMode).

        ``auto``: an unfinished run is resumed (the ledger always applies), a finished one is
        moved aside and started again; ``must``: resume or raise ConfigError; ``never``: earlier
        files are moved aside and the run starts from step 0 (checkpointing.py). Returns the
        checkpoint resumed from (None: none).
        """
        info = self.checkpoints.resume(mode)
        if info is not None:
            self.state.resumed_from = info  # (its checkpoint is on disk: no initial one is saved)
        return info

    def checkpoint(self, reason: str = "on_demand") -> CheckpointEvent:
        """Save now (state before step ``step_count``), wait until it is on disk, publish it.

        ``reason="final"`` also marks the run finished: it will not be resumed.
        (Periodic and requested checkpoints do not wait: see async_checkpoint.py.)
        """
        return self.checkpoints.checkpoint(reason)

    def rollback(
        self, target_step: int, checkpoint_id: str | None = None, onset_step: int | None = None
    ) -> str:
        """Roll back now, as a ROLLBACK action does (steering.Steering.rollback)."""
        return self.steering.rollback(target_step, checkpoint_id, onset_step)

    def planned_steps(self) -> int:
        """The run's length for the recovery budget (steering.Steering.planned_steps)."""
        return self.steering.planned_steps()

    def summary(self) -> RunSummary:
        """The run so far: incidents, actions taken and withheld, and the goodput."""
        c, n = self.state.counters, self.narrator
        return RunSummary(
            self.run_id,
            self.mode.value,
            self.state.step_count,
            c.steps,
            n.rerun_steps,
            c.skipped_batches,
            c.skipped_steps,
            c.skipped_updates,
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
