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

Each ``step`` is two halves around the update (step_halves.py): the step's
statistics with one device-to-host transfer, the actions due at this step, an
update skipped at once when the loss or gradient is non-finite or the step is an
isolated outlier (skip_rule.py); then the StepEvent, published without waiting,
and checkpoints when due (written in the background: async_checkpoint.py). A
restarted run_id resumes with a WARNING (config.ResumeMode); a finished one is
not (lifecycle.py). Step numbers count ``step`` calls; a checkpoint "at step s"
holds the state before step s runs. After a rollback to s the step counter is s
again and ``generation`` (rollbacks applied so far; ``epoch`` on the wire) one
higher; ``guard.data(..., epochs=)`` counts data passes.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from spikeguard.errors import ConfigError
from spikeguard.producers.actions import ActionQueue, Handler
from spikeguard.producers.amp import ScalerControl
from spikeguard.producers.applying import Acknowledgements, ActionApplier
from spikeguard.producers.assembly import GuardParts, assemble
from spikeguard.producers.async_checkpoint import AsyncSaver
from spikeguard.producers.checkpointing import CheckpointKeeper
from spikeguard.producers.checkpoints import CheckpointInfo, CheckpointStore
from spikeguard.producers.clipping import GradClipper
from spikeguard.producers.config import GuardConfig, GuardMode, ResumeMode
from spikeguard.producers.connection import Connection
from spikeguard.producers.data import GuardedLoader
from spikeguard.producers.distributed import RankSync
from spikeguard.producers.health import HealthTracker
from spikeguard.producers.inbox import ActionInbox
from spikeguard.producers.incidents import IncidentRecorder
from spikeguard.producers.io_faults import IOFaults
from spikeguard.producers.ledger import ActionLedger
from spikeguard.producers.lockstep import DecisionWaiter
from spikeguard.producers.lr import LRControl
from spikeguard.producers.misuse import StepWatch, check_loss
from spikeguard.producers.narration import Narrator, RunSummary
from spikeguard.producers.parts import BatchSource, DataPosition, StateParts
from spikeguard.producers.publisher import BackgroundPublisher
from spikeguard.producers.rerun import RerunCheck
from spikeguard.producers.run_events import RunEvents
from spikeguard.producers.run_plan import RunPlan
from spikeguard.producers.run_state import Counters, RunState, run_field
from spikeguard.producers.skip_rule import SkipRule
from spikeguard.producers.skip_samples import SkipIds, leave_out
from spikeguard.producers.stats import GradStats
from spikeguard.producers.step_halves import StepHalves, StepResult
from spikeguard.producers.steering import Steering
from spikeguard.producers.update_norm import UpdateNorm
from spikeguard.producers.wiring import PipelineRuntime
from spikeguard.schemas import Action, ActionKind, CheckpointEvent, Topics
from spikeguard.schemas.signing import Signer

log = logging.getLogger(__name__)


class Guard:
    """Guards one training run; see the module's docstring.

    Where its steps go: by default the Guard opens a runtime of its own (the embedded
    pipeline, or Kafka when ``SPIKEGUARD_BOOTSTRAP_SERVERS`` is set: spikeguard.runtime,
    through wiring.py) and closes it in :meth:`close`. ``runtime=`` hands it one that the
    caller opened (and closes): its bus, its topics and its settings, the signing key among
    them. ``bus=`` and ``topics=`` are for a bus of the caller's own (Kafka or custom); the
    key then comes from ``config.signing_key`` only. ``connect=False``: no bus at all, the
    local protections only.

    Its parts are built by assembly.py over one RunState (run_state.py); none is handed the
    Guard.
    """

    # Its parts, as assembly.GuardParts names them (a test holds the two lists equal): among
    # them the checkpoint keeper (checkpointing.py), the action applier that owns the run's
    # steering (applying.py, steering.py), and the step's two halves (step_halves.py).
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    scaler: Any
    sharded: bool
    run_id: str
    state: RunState
    sync: RankSync
    rank: int
    session: str
    own_runtime: PipelineRuntime | None
    plan: RunPlan
    config: GuardConfig
    store: CheckpointStore
    saver: AsyncSaver
    io_faults: IOFaults
    ledger: ActionLedger
    signer: Signer
    actions: ActionQueue
    stats: GradStats
    updates: UpdateNorm
    clipper: GradClipper
    lr: LRControl
    torch_optimizer: Any
    usage: StepWatch
    amp: ScalerControl
    health: HealthTracker
    position: DataPosition
    incidents: IncidentRecorder
    rerun: RerunCheck
    skip_rule: SkipRule
    parts: StateParts
    data_seed: int | None
    narrator: Narrator
    bus: Any
    topics: Topics
    links: Connection
    publisher: BackgroundPublisher | None
    inbox: ActionInbox | None
    waiter: DecisionWaiter | None
    events: RunEvents
    acks: Acknowledgements
    checkpoints: CheckpointKeeper
    steering: Steering
    applier: ActionApplier
    halves: StepHalves

    step_count = run_field("step_count", "The step the next ``step()`` call is (on_rollback).")
    generation = run_field("generation", "Rollbacks applied so far (``epoch`` on the wire).")
    should_stop = run_field("should_stop", "A stop was applied: the loop should end.")
    stop_reason = run_field("stop_reason", "Why the run stops (None: it does not).")
    max_steps = run_field("max_steps", "The run's length in optimizer steps, when known.")
    finished = run_field("finished", "The run is done and is never resumed (lifecycle.py).")
    resumed_from = run_field("resumed_from", "The checkpoint resumed from (None: none).")

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
        parts: GuardParts = assemble(
            model,
            optimizer,
            scheduler,
            scaler,
            run_id=run_id,
            config=config,
            runtime=runtime,
            bus=bus,
            topics=topics,
            process_group=process_group,
            connect=connect,
            preset=preset,
            policy=policy,
            mode=mode,
            resume=resume,
            options=options,
        )
        vars(self).update(vars(parts))  # each part under its name (the declarations above)
        self.applied = self.acks.applied  # every ack: what was done, newest last
        self._closed = False
        try:
            self.resume(self.config.resume)
        except ConfigError:
            # Refused at the start (resume='must' with nothing to resume, another run's
            # checkpoint_dir): nothing trained, nothing to write; what it opened is let go.
            self._closed = True
            self.usage.close()
            self.saver.close()
            self.links.close(0.0)
            if self.own_runtime is not None:
                self.own_runtime.close()
            raise

    @property
    def counters(self) -> Counters:
        """What the Guard did, counted (run_state.Counters; ``summary()`` puts it in words)."""
        return self.state.counters

    @property
    def mode(self) -> GuardMode:
        return self.steering.mode

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
        """A rollback or stop ended this step in its first half: no update, no scheduler step."""
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

        With gradient accumulation iterate ``guard.data(loader)`` for the micro-batches and call
        it once per optimizer step, after the last backward, with the loss averaged over them:
        steps, checkpoints and skip windows count optimizer steps.
        ``closure`` recomputes this step's loss and calls backward (as for
        ``optimizer.step(closure)``); with ``verify_reruns=1`` a suspicious step is re-run with it.

        It is the two halves a framework's callback calls around the framework's own
        optimizer and scheduler step: ``before_update``, the update, ``after_update``.
        """
        check_loss(loss)
        # (and says once if guard.data was not used)
        self.usage.before_step(loss, self.position.loader)
        halves = self.halves  # before_update and after_update, the loss checked once
        if not halves.started:
            halves.start()
        if halves.before_update(loss, batch, closure):
            self.amp.step(self.lr.step, self.optimizer)  # the Guard's LR factor, the scaler's step
        if self.scheduler is not None and not halves.interrupted:
            self.scheduler.step()
        result = halves.after_update().updated
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
        self.usage.close()
        self.saver.close()
        self.checkpoints.drain()
        self.halves.end(finished, self.loader is not None and self.loader.ran_out)
        self.links.close(self.config.flush_timeout)
        if self.own_runtime is not None:
            self.own_runtime.close()
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
        self.usage.after_step()  # the scheduler's loaded count is where the next step starts

    def resume(self, mode: ResumeMode | str = ResumeMode.AUTO) -> CheckpointInfo | None:
        """Continue from the newest checkpoint of this run, as ``mode`` says (config.ResumeMode;
        CheckpointKeeper.resume). Returns the checkpoint resumed from (None: none)."""
        info = self.checkpoints.resume(mode)
        self.usage.after_step()  # the scheduler's loaded count is where the next step starts
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
        result = self.steering.rollback(target_step, checkpoint_id, onset_step)
        self.usage.after_step()  # the scheduler's loaded count is where the next step starts
        return result

    def summary(self) -> RunSummary:
        """The run so far: incidents, actions taken and withheld, and the goodput."""
        return self.narrator.summary(
            self.state,
            self.mode.value,
            self.lr.scale,
            dict(self.acks.notices),
            self.clipper.recovery_bounds(self.config.max_grad_norm),
        )
