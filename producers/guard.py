"""The Guard: what a plain PyTorch loop adds to be kept alive through spikes.

    guard = Guard(model, optimizer, scheduler, run_id="my-run")
    for x, y in guard.data(loader):            # was: for x, y in loader
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        guard.step(loss)                         # was: optimizer.step(); scheduler.step()
    guard.close()

With gradient accumulation, iterate ``guard.data(loader)`` for the micro-batches
and call ``guard.step(mean_loss)`` once per optimizer step, after the last
backward: steps, checkpoints and skip windows count optimizer steps.

Each ``step`` computes the step's statistics with one device-to-host transfer,
applies the actions due at this step (before this step's update), skips the
update at once when the loss or gradient is non-finite or the step is an
isolated outlier (skip_rule.py), publishes the
StepEvent without waiting (drop-oldest queue), updates, and checkpoints when
due (a CPU copy in the step, written in the background: async_checkpoint.py).
A restarted run_id resumes with a WARNING; a finished one is not resumed
(lifecycle.py). The run's preset and policy are checked when the Guard is
built and published on the runs topic (run_plan.py). Step numbers count ``step`` calls; a checkpoint "at step s" holds the
state before step s runs. After a rollback to s the step counter is s again
and the epoch (rollbacks applied so far) one higher.
"""

from __future__ import annotations

import logging
import math
import os
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Callable

import torch

from spikeguard.producers.amp import ScalerControl
from spikeguard.producers.async_checkpoint import AsyncSaver
from spikeguard.producers.applying import ActionApplying
from spikeguard.producers.checkpointing import Checkpointing
from spikeguard.producers.actions import ActionFailed, ActionQueue, Handler
from spikeguard.producers.checkpoints import CheckpointStore
from spikeguard.producers.clipping import GradClipper
from spikeguard.producers.config import GuardConfig
from spikeguard.producers.data import GuardedLoader
from spikeguard.producers.distributed import RankSync
from spikeguard.producers.health import HealthTracker
from spikeguard.producers.inbox import ActionInbox
from spikeguard.producers.ledger import SIDECAR, ActionLedger
from spikeguard.producers.lockstep import DecisionWaiter
from spikeguard.producers.lr import LRControl
from spikeguard.producers.parts import DataPosition, ModelPart, RNGPart, StateParts
from spikeguard.producers.publisher import BackgroundPublisher
from spikeguard.producers.run_events import RunEvents
from spikeguard.producers.run_plan import make_plan
from spikeguard.producers.sharded import ShardedState, model_is_sharded
from spikeguard.producers.incidents import IncidentRecorder
from spikeguard.producers.rerun import RerunCheck
from spikeguard.producers.skip_rule import SkipRule
from spikeguard.producers.stats import GradStats
from spikeguard.schemas import Action, ActionKind, Topics

log = logging.getLogger(__name__)


class Guard(Checkpointing, ActionApplying):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                 *, run_id: str | None = None, config: GuardConfig | None = None, bus: Any = None,
                 topics: Topics | None = None, scaler: Any = None, process_group: Any = None,
                 connect: bool = True, preset: str | None = None,
                 policy: dict[str, Any] | None = None) -> None:
        self.sharded = model_is_sharded(model)  # FSDP2 / DTensor (sharded.py); FSDP1 refused, first
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.run_id = run_id or os.environ.get("SPIKEGUARD_RUN_ID") or f"run-{uuid.uuid4().hex[:12]}"
        self.sync = RankSync(process_group)
        self.rank = self.sync.rank
        self._runtime = None
        settings = None
        if bus is None and connect and (self.rank == 0 or (config is not None and config.publish_all_ranks)):
            from spikeguard.runtime import open_runtime  # embedded pipeline threads, or Kafka

            self._runtime = open_runtime()
            bus, topics, settings = self._runtime.bus, topics or self._runtime.topics, self._runtime.settings
        cfg = config or getattr(settings, "guard", None) or GuardConfig()
        # The run's preset and policy, checked against the checkpoint settings (run_plan.py).
        self.plan = make_plan(cfg, preset, policy)
        self.config = cfg = self.plan.config
        directory = Path(cfg.checkpoint_dir or Path("spikeguard-checkpoints") / self.run_id)
        self.store = CheckpointStore(directory, self.run_id, cfg.keep_checkpoints, self.rank)
        # torch.save off the training thread; a sharded model's DCP save is collective: on this one.
        self.saver = AsyncSaver(self.store, cfg.async_checkpoint and not self.sharded)
        self.ledger = ActionLedger(directory / SIDECAR, cfg.max_applied_ids)
        # The key: the Guard's own config, else its runtime's, else the one an embedded
        # runtime left on the bus it was handed (that pipeline refuses unsigned steps).
        key = (cfg.signing_key or getattr(settings, "signing_key", None)
               or getattr(bus, "signing_key", None))
        self.actions = ActionQueue(self.ledger, key)
        self.handlers: dict[ActionKind, Handler] = {}
        self.stats = GradStats(list(model.named_parameters()), cfg.top_k_layers, cfg.param_norm)
        self.clipper = GradClipper(cfg.clip_beta, cfg.clip_warmup, cfg.clip_track_z)
        self.lr = LRControl(optimizer)
        self.amp = ScalerControl(scaler)
        self.health = HealthTracker(cfg.incident_window, cfg.healthy_stretch)
        self.position = DataPosition(cfg.history_steps)
        self.incidents = IncidentRecorder(directory, self.run_id, cfg.provenance_window)  # forensics
        self.rerun = RerunCheck(cfg.verify_reruns)
        self.skip_rule = SkipRule(max_run=cfg.skip_max_run) if cfg.skip_outliers else None
        # Everything a checkpoint holds and a rollback puts back, in load order.
        weights = ([("sharded", ShardedState(model, optimizer))] if self.sharded  # every rank its shards
                   else [("model", ModelPart(model)), ("optimizer", optimizer)])
        self.parts = StateParts([
            *weights, ("scheduler", scheduler),
            ("scaler", scaler), ("rng", RNGPart()), ("lr", self.lr), ("clip", self.clipper),
            ("health", self.health), ("ledger", self.ledger), ("skip_rule", self.skip_rule),
            ("data", self.position)], per_rank=("rng", "sharded"))
        self.data_seed = cfg.data_seed if cfg.data_seed is not None else torch.initial_seed()
        self.step_count, self.epoch = 0, 0
        self.should_stop, self.stop_reason = False, None
        self.max_steps: int | None = None
        # With gradient accumulation a step reads several micro-batches, so skips are counted
        # in both units: skipped_updates (optimizer steps the guard skipped itself) and
        # skipped_update_batches (their micro-batches); skipped_steps and skipped_batches
        # (data skipped by SKIP_BATCHES actions).
        self.counters = dict(steps=0, updates=0, skipped_updates=0, skipped_update_batches=0,
                             rollbacks=0, checkpoints=0, actions_applied=0, acks=0,
                             skipped_batches=0, skipped_steps=0, scaler_skips=0, outlier_skips=0,
                             transient_steps=0)
        self.applied: deque[dict] = deque(maxlen=1000)  # what was done, newest last
        self.resumed_from = None
        self._checkpoint_requests: list[tuple[Action, str]] = []
        self._resolved = 0
        self._started = False
        self._batch_seen = False
        self._closed = False
        self.finished = False  # see lifecycle.py: a finished run is never resumed
        self.bus, self.topics = bus, topics or Topics()
        self.publisher = self.inbox = self.waiter = None
        if bus is not None:
            t = self.topics
            bus.create_topics([t.steps, t.acks, t.checkpoints, t.actions, t.decisions])
            bus.create_topics([t.runs], compacted=True)
            self.publisher = BackgroundPublisher(bus.producer(), self.run_id, cfg.queue_size,
                                                 threaded=not cfg.lockstep,
                                                 signing_key=self.actions.signing_key)
            if self.rank == 0:
                self.inbox = ActionInbox(bus, t, self.run_id, 0, threaded=not cfg.lockstep)
                if cfg.lockstep:
                    self.waiter = DecisionWaiter(bus, t, self.run_id, cfg.lockstep_timeout)
        self.events = RunEvents(self.publisher, self.topics, self.run_id, self.rank, cfg.publish_all_ranks)
        if cfg.resume:
            self.resume()

    # -- the user's API ------------------------------------------------------
    def data(self, loader: Any, epochs: int | None = None, max_steps: int | None = None,
             sample_ids: Callable[[Any], list] | None = None) -> GuardedLoader:
        """``loader`` wrapped: global batch index, resume after rollback, skips, fixed order.

        ``sample_ids(batch)`` names the samples of a batch for incident forensics; by default
        a map-style loader's dataset indices are recorded (forensics/provenance.py).
        """
        self.max_steps = max_steps if max_steps is not None else self.max_steps
        if self.loader is None or self.loader.loader is not loader:
            self.incidents.attach(loader, sample_ids)
            self.position.attach(GuardedLoader(loader, seed=self.data_seed, epochs=epochs,
                                               stop_when=self._done, before_batch=self._start,
                                               on_batch=self._batch_read,
                                               on_open=self.incidents.restart))
        elif epochs is not None:
            self.loader.epochs = epochs
        return self.loader

    @property
    def loader(self) -> GuardedLoader | None:
        return self.position.loader

    def on(self, kind: ActionKind | str, handler: Handler) -> None:
        """Register ``handler(action, guard) -> result text`` for an action kind."""
        self.handlers[ActionKind(kind)] = handler

    def step(self, loss: torch.Tensor | float, batch: Any = None,
             closure: Callable[[], torch.Tensor] | None = None) -> bool:
        """Replaces ``optimizer.step()`` (and ``scheduler.step()``); True when the update was applied.

        With gradient accumulation call it once per optimizer step, after the last
        micro-batch's backward, with the loss averaged over the micro-batches.
        ``closure`` recomputes this step's loss and calls backward (as for
        ``optimizer.step(closure)``); with ``verify_reruns=1`` a suspicious step is re-run with it.
        """
        self._start()
        step = self.step_count
        self._collect(step)
        due = self.actions.due(step) if self.rank == 0 else []
        self.amp.begin(self.optimizer)  # statistics and clipping are about the unscaled gradients
        stats, grads = self.stats.compute(loss, batch, self._riders(bool(due)))
        shared = stats.riders
        loss_scale = self.amp.scale()
        # Under a GradScaler an inf/NaN gradient with a finite loss is the scaler's own business.
        overflow = self.amp.enabled and math.isfinite(stats.loss) and not stats.finite
        if self.sync.enabled:
            nonfinite = shared["any_nonfinite"] > 0
        else:
            nonfinite = not math.isfinite(stats.loss) if self.amp.enabled else not stats.finite
        if shared["any_due"] > 0 if self.sync.enabled else bool(due):
            if self.sync.enabled:
                sent = [a.model_dump(mode="json") for a in due] if self.rank == 0 else None
                due = [Action.model_validate(d) for d in self.sync.broadcast(sent)]
            if self._apply(due, step):  # rolled back or stopped: this step's update is void
                self._zero_grads()
                self.amp.void()
                self._maybe_checkpoint(requests_only=True)
                self._drain_saves()
                self._finish_actions()
                return False
        reason = "non_finite" if nonfinite and self.config.skip_nonfinite else None
        if reason is None and self.skip_rule is not None and not overflow:
            reason = self._outlier(step, stats)
        rerun = None
        if reason is not None and self.rerun.enabled and not (self.sync.enabled or self.amp.enabled):
            # (one rank's re-run would split the ranks; a scaler's re-run gradients come scaled)
            stats, rerun = self.rerun.judge(closure, [p for p in self.model.parameters() if p.requires_grad],
                                            stats)
            if rerun == "transient":
                reason = "transient"
                self.counters["transient_steps"] += 1
        if reason is not None:
            self._zero_grads()
            self.amp.void()
            self.counters["skipped_updates"] += 1
        else:
            if stats.grad_norm is not None and not overflow:
                self.clipper.clip(grads, stats.grad_norm)
            self.amp.step(self.lr.step, self.optimizer, overflow)
            if overflow:
                reason = "scaler_overflow"
                self.counters["scaler_skips"] += 1
            else:
                self.counters["updates"] += 1
            if stats.grad_norm is not None:
                self.clipper.observe(stats.grad_norm)
        self.events.step(step, self.epoch, stats, lr=self.lr.effective(), reason=reason,
                         loss_scale=loss_scale, overflow_streak=self.amp.streak,
                         batch_index=self.loader.last_index if self.loader is not None else None,
                         rerun=rerun)
        self.actions.published.remember(self.epoch, step, stats.loss,  # checked against action evidence
                                        None if reason == "scaler_overflow" else stats.grad_norm)
        if self.scheduler is not None:
            self.scheduler.step()
        self.health.observe(step, not (nonfinite or reason == "outlier_step"))  # a local onset
        batches = self.position.record(step)  # micro-batches this step read (accumulation)
        self.incidents.step(step)
        self._batch_seen = False
        self.rerun.before_step()  # the next forward's random streams (again at its first batch)
        if reason in ("non_finite", "outlier_step"):
            self.counters["skipped_update_batches"] += batches
        self.step_count += 1
        self.counters["steps"] += 1
        self._maybe_checkpoint()
        self._drain_saves()
        self._finish_actions()
        if self.waiter is not None:
            self.waiter.follow(self.inbox, self.epoch, step, self.config.lockstep_settle)
        return reason is None

    def close(self, finished: bool | None = None) -> None:
        """Flush everything; ``finished`` (default: the planned steps ran, or the data ran out)."""
        if self._closed:
            return
        self._closed = True
        self.saver.close()
        self._drain_saves()
        if finished is None:
            planned = self.max_steps is not None and self.step_count >= self.max_steps
            ran_out = self.loader is not None and self.loader.ran_out
            finished = not self.should_stop and (planned or ran_out)
        self.finished = self.finished or finished
        self._persist_ledger()
        if self._started:
            self.events.run("end", self.plan, self.max_steps, self.step_count, self.epoch, self.finished,
                            self.stop_reason or ("finished" if self.finished else "closed"))
        for part in (self.waiter, self.inbox):
            if part is not None:
                part.close()
        if self.publisher is not None:
            self.publisher.close(self.config.flush_timeout)
        if self._runtime is not None:
            self._runtime.close()

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

    def rollback(self, target_step: int, checkpoint_id: str | None = None) -> str:
        self.saver.wait()  # the checkpoint it needs may still be being written
        self._drain_saves()
        info = self.store.find(checkpoint_id) if checkpoint_id else None
        note = ""
        if info is None or info.step > target_step:
            info = self.store.newest_healthy(max_step=target_step)
            note = f" (checkpoint {checkpoint_id} not found; newest healthy at or before {target_step})"
        if info is None:
            raise ActionFailed(f"no checkpoint at or before step {target_step} to roll back to")
        self.load_state_dict(self.store.load(info))
        self.epoch += 1
        self.step_count = info.step
        self.should_stop = False
        self.position.rewind(info.step)
        self.counters["rollbacks"] += 1
        return f"rolled back to step {info.step} ({info.checkpoint_id}), now epoch {self.epoch}{note}"

    def skip_steps(self, from_step: int, to_step: int, extra: int = 0, after_rollback: bool = False) -> str:
        start, end, steps = self.position.skip_steps(from_step, to_step, extra, after_rollback)
        self.counters["skipped_batches"] += end - start + 1
        self.counters["skipped_steps"] += steps
        text = f"skipping batches {start}..{end}"
        if end - start + 1 != steps:  # gradient accumulation: say both
            text += f" ({end - start + 1} micro-batches, {steps} optimizer steps)"
        return text

    # -- what actions call ---------------------------------------------------
    def request_stop(self, reason: str) -> None:
        self.should_stop, self.stop_reason = True, reason

    # -- internals ------------------------------------------------------------
    def _done(self) -> bool:
        return self.should_stop or (self.max_steps is not None and self.step_count >= self.max_steps)

    def _batch_read(self, batch: Any, used: bool) -> None:
        self.incidents.batch(batch, used)
        if used and not self._batch_seen:  # reading a batch may draw from the global RNG: after it
            self._batch_seen = True
            self.rerun.before_step()

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self.events.run("start", self.plan, self.max_steps, self.step_count, self.epoch, False,
                            "resumed" if self.resumed_from is not None else "new")
            if self.store.newest() is None and self.saver.in_flight is None:
                self._save("periodic")  # a rollback target before anything can go wrong

    def _riders(self, due: bool):
        """The rank flags, all-reduced on device, ride along with the statistics' one transfer."""
        if not self.sync.enabled:
            return None
        if self.amp.enabled:  # an inf gradient is the scaler's overflow; only the loss counts here
            return lambda bad, loss, norm: self.sync.flags((~torch.isfinite(loss)).float(), due, loss, norm)
        return lambda bad, loss, norm: self.sync.flags(bad, due, loss, norm)

    def _outlier(self, step: int, stats: Any) -> str | None:
        """The local skip rule, on values every rank shares (the largest of any rank)."""
        r = stats.riders
        loss, grad = (r["max_loss"], r["max_grad_norm"]) if self.sync.enabled else (stats.loss, stats.grad_norm)
        decision = self.skip_rule.decide(loss, None if grad is None or grad < 0 else grad,
                                         self.lr.effective())
        if decision.skip:
            self.counters["outlier_skips"] += 1
            log.info("spikeguard: step %d skipped at once: %s outlier (loss z=%s, grad z=%s)",
                     step, decision.signal, decision.loss_z, decision.grad_z)
        return "outlier_step" if decision.skip else None

    def _zero_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

