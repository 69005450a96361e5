"""How a Guard's parts are made and wired, in the order they need each other.

:func:`assemble` resolves where the run's records go (a runtime handed in or
opened through wiring.py, a bus of the caller's, or none), its settings (the
config, then the ``mode=`` and ``resume=`` arguments, then the preset and
policy: run_plan.py), and builds every part over one
:class:`~spikeguard.producers.run_state.RunState`: what measures a step, what
a checkpoint holds, the links on the bus, the checkpoint keeper, the run's
steering and its action applier, and the step's two halves. No part is handed
the Guard; the Guard holds the :class:`GuardParts` under the same names.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spikeguard.producers.actions import ActionQueue
from spikeguard.producers.amp import ScalerControl
from spikeguard.producers.applying import Acknowledgements, ActionApplier
from spikeguard.producers.async_checkpoint import AsyncSaver
from spikeguard.producers.budget import RecoveryBudget
from spikeguard.producers.checkpointing import CheckpointKeeper
from spikeguard.producers.checkpoints import CheckpointStore
from spikeguard.producers.clipping import GradClipper
from spikeguard.producers.config import GuardConfig, GuardMode, ResumeMode
from spikeguard.producers.connection import Connection, open_links, warn_unsigned
from spikeguard.producers.distributed import RankSync
from spikeguard.producers.health import HealthTracker
from spikeguard.producers.inbox import ActionInbox
from spikeguard.producers.incidents import IncidentRecorder
from spikeguard.producers.io_faults import IOFaults
from spikeguard.producers.ledger import SIDECAR, ActionLedger
from spikeguard.producers.lockstep import DecisionWaiter
from spikeguard.producers.lr import LRControl
from spikeguard.producers.misuse import StepWatch, guard_options_error
from spikeguard.producers.narration import Narrator
from spikeguard.producers.parts import DataPosition, ModelPart, RNGPart, StateParts
from spikeguard.producers.publisher import BackgroundPublisher
from spikeguard.producers.rerun import RerunCheck
from spikeguard.producers.run_events import RunEvents
from spikeguard.producers.run_plan import RunPlan, make_plan
from spikeguard.producers.run_state import RunState
from spikeguard.producers.sharded import ShardedState, model_is_sharded
from spikeguard.producers.skip_rule import SkipRule
from spikeguard.producers.stats import GradStats
from spikeguard.producers.steering import Steering
from spikeguard.producers.step_halves import OwnLoop, StepHalves
from spikeguard.producers.update import torch_optimizer
from spikeguard.producers.update_norm import UpdateNorm
from spikeguard.producers.wiring import WIRING, PipelineRuntime, action_loggers
from spikeguard.schemas import Topics, new_session
from spikeguard.schemas.signing import Signer


@dataclass
class GuardParts:
    """Everything a Guard is made of, under the names the Guard gives them."""

    model: torch.nn.Module
    optimizer: Any  # a torch optimizer, or a framework's wrapper with its param_groups
    scheduler: Any
    scaler: Any
    sharded: bool  # FSDP2 / DTensor (sharded.py)
    run_id: str
    state: RunState
    sync: RankSync
    rank: int
    session: str  # in every record the run publishes; every action it takes must name it
    own_runtime: PipelineRuntime | None  # opened by the Guard, so closed by it
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
    torch_optimizer: Any  # the torch optimizer a scaler steps (None: none found)
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


def settings_of(
    config: GuardConfig | None,
    settings: Any,
    mode: GuardMode | str | None,
    resume: ResumeMode | str | bool | None,
) -> GuardConfig:
    """The Guard's config: its own, else its runtime's, with ``mode=`` and ``resume=`` on top."""
    cfg = config or getattr(settings, "guard", None) or GuardConfig()
    given = {k: v for k, v in (("mode", mode), ("resume", resume)) if v is not None}
    if given:  # the arguments win over the config (validated as the config's own fields)
        checked = GuardConfig.model_validate(given)
        cfg = cfg.model_copy(update={k: getattr(checked, k) for k in given})
    return cfg


def assemble(
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    *,
    run_id: str | None,
    config: GuardConfig | None,
    runtime: PipelineRuntime | None,
    bus: Any,
    topics: Topics | None,
    process_group: Any,
    connect: bool,
    preset: str | None,
    policy: dict[str, Any] | None,
    mode: GuardMode | str | None,
    resume: ResumeMode | str | bool | None,
    options: dict[str, Any],
) -> GuardParts:
    """A Guard's parts (see the module's docstring), from the Guard's arguments, checked first."""
    if options:  # a setting given where GuardConfig takes it
        raise guard_options_error(options, set(GuardConfig.model_fields))
    if runtime is not None and (bus is not None or topics is not None):
        both = " and ".join(n for n, v in (("bus", bus), ("topics", topics)) if v is not None)
        raise TypeError(
            f"Guard got both runtime= and {both}=: a runtime brings its own bus, topics "
            "and signing key; pass runtime= alone, or bus= and topics= for a bus of your own"
        )
    sharded = model_is_sharded(model)  # FSDP1 refused, first
    run_id = run_id or os.environ.get("SPIKEGUARD_RUN_ID") or f"run-{uuid.uuid4().hex[:12]}"
    run = RunState(run_id)
    sync = RankSync(process_group)
    rank = sync.rank
    session: str = sync.share(new_session())
    own_runtime = None
    publishes = rank == 0 or (config is not None and config.publish_all_ranks)
    if runtime is None and bus is None and connect and publishes and WIRING.open_runtime:
        runtime = own_runtime = WIRING.open_runtime()  # embedded pipeline, or Kafka
    settings = None
    if runtime is not None:
        bus, topics, settings = runtime.bus, topics or runtime.topics, runtime.settings
    # The run's preset and policy, checked against the checkpoint settings (run_plan.py).
    plan = make_plan(settings_of(config, settings, mode, resume), preset, policy)
    cfg = plan.config
    directory = Path(cfg.checkpoint_dir or Path("spikeguard-checkpoints") / run_id)
    store = CheckpointStore(directory, run_id, cfg.keep_checkpoints, rank)
    # torch.save off the training thread; a sharded model's DCP save is collective: on this one.
    saver = AsyncSaver(store, cfg.async_checkpoint and not sharded)
    io_faults = IOFaults(run_id)  # its own writes fail without ending the run
    ledger = ActionLedger(directory / SIDECAR, cfg.max_applied_ids, io_faults)
    # The one signer of this Guard's records and checker of its actions: the Guard's own
    # config's key, else its runtime's. A bus handed alone carries no key.
    signer = Signer(cfg.signing_key or (settings.keys() if settings is not None else None))
    if bus is not None and settings is None and signer.key is None:
        warn_unsigned(run_id)
    actions = ActionQueue(ledger, signer)
    stats = GradStats(list(model.named_parameters()), cfg.top_k_layers, cfg.param_norm)
    updates = UpdateNorm(list(model.parameters()), cfg.update_norm)  # normed at the next step
    # (the user's own max_grad_norm: clipped after measuring, so the true norm is published)
    clipper = GradClipper(cfg.clip_beta, cfg.clip_warmup, cfg.clip_track_z, cfg.max_grad_norm)
    lr = LRControl(optimizer)
    stepped = torch_optimizer(optimizer, required=False)
    usage = StepWatch(stepped, run_id, scheduler)  # two updates for one batch (misuse.py)
    amp = ScalerControl(scaler)
    health = HealthTracker(cfg.incident_window, cfg.healthy_stretch)
    position = DataPosition(cfg.history_steps)
    incidents = IncidentRecorder(directory, run_id, cfg.provenance_window, faults=io_faults)
    rerun = RerunCheck(cfg.verify_reruns)
    # The local outlier model always scores (it backs decisions: evidence.py); it skips
    # only with skip_outliers.
    skip_rule = SkipRule(max_run=cfg.skip_max_run)
    # Everything a checkpoint holds and a rollback puts back, in load order.
    weights: list[tuple[str, Any]] = (
        [("sharded", ShardedState(model, optimizer))]  # every rank its shards
        if sharded
        else [("model", ModelPart(model)), ("optimizer", optimizer)]
    )
    parts = StateParts(
        [
            *weights,
            ("scheduler", scheduler),
            ("scaler", scaler),
            ("rng", RNGPart()),
            ("lr", lr),
            ("clip", clipper),
            ("health", health),
            ("ledger", ledger),
            ("skip_rule", skip_rule),
            ("data", position),
        ],
        per_rank=("rng", "sharded"),
    )
    narrator = Narrator(run_id, action_loggers(cfg.loggers))
    topics = topics or Topics()
    links = open_links(bus, topics, run, session=session, signer=signer, config=cfg, rank=rank)
    events = RunEvents(links.publisher, topics, run_id, rank, cfg.publish_all_ranks, session)
    acks = Acknowledgements(run, events)
    watch = links.watch
    checkpoints = CheckpointKeeper(
        run,
        saver=saver,
        parts=parts,
        ledger=ledger,
        position=position,
        lr=lr,
        clipper=clipper,
        health=health,
        incidents=incidents,
        events=events,
        io_faults=io_faults,
        sync=sync,
        config=cfg,
        sharded=sharded,
        ack=acks.send,
        judged=None if watch is None else (lambda: watch.judged),
        min_rollback_steps=plan.min_rollback_steps,
    )
    steering = Steering(
        run,
        mode=cfg.mode,
        budget=RecoveryBudget(cfg.max_skip_share, cfg.max_rerun_share, cfg.recovery_min_steps),
        narrator=narrator,
        lr=lr,
        clipper=clipper,
        optimizer=optimizer,
        actions=actions,
        ledger=ledger,
        checkpoints=checkpoints,
        position=position,
    )
    applier = ActionApplier(
        run,
        actions=actions,
        ledger=ledger,
        inbox=links.inbox,
        waiter=links.waiter,
        sync=sync,
        health=health,
        checkpoints=checkpoints,
        acks=acks,
        steering=steering,
    )
    halves = StepHalves(
        run,
        config=cfg,
        plan=plan,
        params=lambda: [p for p in model.parameters() if p.requires_grad],
        torch_optimizer=stepped,
        stats=stats,
        updates=updates,
        amp=amp,
        sync=sync,
        skip_rule=skip_rule,
        rerun=rerun,
        applier=applier,
        checkpoints=checkpoints,
        events=events,
        incidents=incidents,
        inbox=links.inbox,
        waiter=links.waiter,
        loop=OwnLoop(optimizer, amp),
    )
    return GuardParts(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        sharded=sharded,
        run_id=run_id,
        state=run,
        sync=sync,
        rank=rank,
        session=session,
        own_runtime=own_runtime,
        plan=plan,
        config=cfg,
        store=store,
        saver=saver,
        io_faults=io_faults,
        ledger=ledger,
        signer=signer,
        actions=actions,
        stats=stats,
        updates=updates,
        clipper=clipper,
        lr=lr,
        torch_optimizer=stepped,
        usage=usage,
        amp=amp,
        health=health,
        position=position,
        incidents=incidents,
        rerun=rerun,
        skip_rule=skip_rule,
        parts=parts,
        data_seed=cfg.data_seed,  # None: the loader's own draws, as unguarded (data.py)
        narrator=narrator,
        bus=bus,
        topics=topics,
        links=links,
        publisher=links.publisher,
        inbox=links.inbox,
        waiter=links.waiter,
        events=events,
        acks=acks,
        checkpoints=checkpoints,
        steering=steering,
        applier=applier,
        halves=halves,
    )
