"""An outage never changes a decision: the same spike, live and through an outage, gets the same rollback.

The finding: the broker stopped for ~21 s across a real spike; fusion's wall-
clock deadline fired during the outage and decided the spike with three
detectors "missing" (``loss_spike``, not critical), although all four verdicts
arrived later (the rules said ``extreme_loss``, critical): no rollback.

Here the four real detector stages judge a generated run with a spike (signed
steps, real Workers, the embedded bus); their verdicts then reach fusion and
the actuator (real stages, real Workers, signing) twice: live, and with only
one detector's verdict for the spike step in before a 21 s outage (the
workers' clock runs on while nothing arrives) and the rest after it. Both give
the same decisions, the critical one included, and the same rollback.
"""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import DETECTOR_NAMES, build_stage
from spikeguard.lab.simulate import generate
from spikeguard.metrics import Metrics
from spikeguard.schemas import (
    Action,
    ActionKind,
    CheckpointEvent,
    Decision,
    Topics,
    Verdict,
    decode,
    encode,
)
from spikeguard.schemas.signing import sign
from spikeguard.settings import load_settings
from spikeguard.processors.fusion_stage import QUIET_GAP_S
from spikeguard.streaming.worker import Worker

KEY = "outage-key-0123456789abcdef"
TOPICS = Topics("outage.")
RUN = "r1"
SETTINGS = load_settings({"topic_prefix": TOPICS.prefix, "signing_key": KEY}, env={})


class Clock:
    """The workers' wall clock: real time plus however long the outage has lasted."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def worker(bus: EmbeddedBus, name: str, clock: Clock | None = None, settings=SETTINGS) -> Worker:
    stage = build_stage(name, settings, TOPICS)
    if clock is not None:
        stage.wall_clock = clock  # fusion stamps arrivals with it
    return Worker(
        bus,
        stage,
        metrics=Metrics(CollectorRegistry()),
        snapshots=False,
        **({"clock": clock} if clock is not None else {}),
    )


def run_all(workers: list[Worker], clock: Clock | None = None, tick_s: float = 0.0) -> None:
    while True:
        if clock is not None:
            clock.now += tick_s
        if not sum(w.run_once(timeout=0) for w in workers):
            return


def the_detectors_verdicts() -> tuple[list[Verdict], int]:
    """The four real detectors' signed verdicts on a run with a spike, and the spike's step."""
    bus = EmbeddedBus(partitions=1)
    detectors = [worker(bus, name) for name in DETECTOR_NAMES]
    producer = bus.producer()
    events = generate("sudden_spike", 260, 3, run_id=RUN).events[:200]
    # A spike no detector can miss at step 180: the loss x1000, the gradient norm x100.
    events = [
        e.model_copy(update={"loss": e.loss * 1000, "grad_norm": (e.grad_norm or 1.0) * 100})
        if e.step == 180
        else e
        for e in events
    ]
    for event in events:
        producer.publish(TOPICS.steps, encode(sign(event, KEY)), key=RUN)
    run_all(detectors)
    verdicts = [decode(r.value, Verdict) for r in bus.read_all(TOPICS.verdicts)]
    assert len(verdicts) == len(events) * len(DETECTOR_NAMES)
    spike = min(v.step for v in verdicts if v.is_anomaly and v.critical)
    return verdicts, spike


def decide(
    verdicts: list[Verdict], spike: int, outage_s: float
) -> tuple[list[Decision], list[Action]]:
    """Fusion and the actuator on ``verdicts``; with an outage, the spike's verdicts but one wait ``outage_s``."""
    bus, clock = EmbeddedBus(partitions=1), Clock()
    pipeline = [worker(bus, "fusion", clock), worker(bus, "actuator", clock)]
    producer = bus.producer()
    producer.publish(
        TOPICS.checkpoints,
        encode(sign(CheckpointEvent(run_id=RUN, step=40, checkpoint_id="c40", healthy=True), KEY)),
        key=RUN,
    )
    run_all(pipeline, clock, 0.01)
    before = [
        v for v in verdicts if v.step < spike or (v.step == spike and v.detector == "predictor")
    ]
    after = [v for v in verdicts if v not in before]
    for v in before:
        producer.publish(TOPICS.verdicts, encode(v), key=RUN)
    run_all(pipeline, clock, 0.01)
    if outage_s:
        for _ in range(
            int(outage_s * 10)
        ):  # the broker is away: nothing arrives, the workers poll on
            clock.now += 0.1
            run_all(pipeline)
    for v in after:
        producer.publish(TOPICS.verdicts, encode(v), key=RUN)
    run_all(pipeline, clock, 0.01)
    for w in pipeline:
        w.drain()
    decisions = [decode(r.value, Decision) for r in bus.read_all(TOPICS.decisions)]
    actions = [decode(r.value, Action) for r in bus.read_all(TOPICS.actions)]
    return decisions, [a for a in actions if a.kind is not ActionKind.PULSE]


@pytest.mark.heavy
def test_a_21s_outage_across_a_spike_changes_no_decision_and_no_rollback():
    verdicts, spike = the_detectors_verdicts()
    live, live_actions = decide(verdicts, spike, outage_s=0)
    through, through_actions = decide(verdicts, spike, outage_s=21)

    def what(d: Decision) -> tuple:
        return d.step, d.is_anomaly, d.type, d.critical, round(d.confidence, 9), tuple(d.missing)

    assert [what(d) for d in through] == [what(d) for d in live]
    (critical,) = [d for d in live if d.step == spike]
    assert (
        critical.critical and critical.is_anomaly
    )  # a critical verdict decides without waiting for all
    rollback = [
        (a.kind, a.params.target_step) for a in live_actions if a.kind is ActionKind.ROLLBACK
    ]
    assert rollback == [(ActionKind.ROLLBACK, 40)]
    assert [(a.kind, a.action_id) for a in through_actions] == [
        (a.kind, a.action_id) for a in live_actions
    ]


def decide_with_a_late_rejoin(
    verdicts: list[Verdict],
    spike: int,
    late: str,
    outage_s: float,
    lag_s: float,
    back: bool = True,
    settings=SETTINGS,
) -> tuple[list[Decision], list[Action]]:
    """Fusion and the actuator on ``verdicts`` through an outage that begins a few steps before the
    spike: afterwards the other detectors catch up over ``lag_s`` while ``late`` first replays the
    verdicts before the outage (from its snapshot) and judges the rest only then (never if not
    ``back``). The others' verdicts flow without a pause: fusion's flow clock runs."""
    bus, clock = EmbeddedBus(partitions=1), Clock()
    pipeline = [worker(bus, "fusion", clock, settings), worker(bus, "actuator", clock, settings)]
    producer = bus.producer()
    producer.publish(
        TOPICS.checkpoints,
        encode(sign(CheckpointEvent(run_id=RUN, step=40, checkpoint_id="c40", healthy=True), KEY)),
        key=RUN,
    )
    run_all(pipeline, clock, 0.01)
    cut = spike - 5
    for v in verdicts:
        if v.step < cut:
            producer.publish(TOPICS.verdicts, encode(v), key=RUN)
    run_all(pipeline, clock, 0.01)
    for _ in range(int(outage_s * 10)):  # the broker is away: nothing arrives, the workers poll on
        clock.now += 0.1
        run_all(pipeline)
    replayed = [v for v in verdicts if v.detector == late and cut - 5 <= v.step < cut]
    for v in replayed:  # its consumer rejoined at its last snapshot: the same verdicts again
        producer.publish(TOPICS.verdicts, encode(v), key=RUN)
    steps = sorted({v.step for v in verdicts if v.step >= cut})
    assert lag_s / len(steps) < QUIET_GAP_S
    for step in steps:  # the others catch up, step by step, over lag_s
        for v in verdicts:
            if v.step == step and v.detector != late:
                producer.publish(TOPICS.verdicts, encode(v), key=RUN)
        clock.now += lag_s / len(steps)
        run_all(pipeline)
    if back:
        for v in verdicts:
            if v.step >= cut and v.detector == late:
                producer.publish(TOPICS.verdicts, encode(v), key=RUN)
        run_all(pipeline, clock, 0.01)
        for (
            w
        ) in pipeline:  # end of input (without the late detector back, what is still pending stays)
            w.drain()
    decisions = [decode(r.value, Decision) for r in bus.read_all(TOPICS.decisions)]
    actions = [decode(r.value, Action) for r in bus.read_all(TOPICS.actions)]
    return decisions, [a for a in actions if a.kind is not ActionKind.PULSE]


def test_a_detector_that_rejoins_seconds_after_the_others_is_waited_for():
    """The broker-outage finding under load: after the outage the rules worker came back well after
    the other detectors (rejoining its group, replaying from its snapshot), the others' verdicts
    moved fusion's flow clock past its deadline, and the spike was decided without the rules'
    critical ``extreme_loss`` (a non-critical ``divergence``: no rollback)."""
    verdicts, spike = the_detectors_verdicts()
    live, live_actions = decide(verdicts, spike, outage_s=0)
    through, through_actions = decide_with_a_late_rejoin(
        verdicts, spike, "rules", outage_s=30, lag_s=12
    )

    def what(
        d: Decision,
    ) -> tuple:  # who else had spoken when a critical verdict decided alone is timing
        return (
            d.step,
            d.is_anomaly,
            d.type,
            d.critical,
            round(d.confidence, 9),
            () if d.critical else tuple(d.missing),
        )

    assert [what(d) for d in through] == [what(d) for d in live]
    assert [(a.kind, a.action_id) for a in through_actions] == [
        (a.kind, a.action_id) for a in live_actions
    ]
    assert [a.kind for a in through_actions].count(ActionKind.ROLLBACK) == 1


def test_a_detector_that_died_in_the_outage_is_given_up_on_after_the_recovery_time():
    verdicts, spike = the_detectors_verdicts()
    settings = load_settings(
        {
            "topic_prefix": TOPICS.prefix,
            "signing_key": KEY,
            "fusion": {"deadline_seconds": 5.0, "recovery_seconds": 10.0},
        },
        env={},
    )
    # The others catch up past the deadline but within the recovery time: nothing past the
    # outage is decided without rules.
    waiting, _ = decide_with_a_late_rejoin(
        verdicts, spike, "rules", outage_s=30, lag_s=8, back=False, settings=settings
    )
    assert max(d.step for d in waiting) == spike - 6
    # Past it, the steps are decided without rules, which is listed as missing.
    given_up, _ = decide_with_a_late_rejoin(
        verdicts, spike, "rules", outage_s=30, lag_s=20, back=False, settings=settings
    )
    late = [d for d in given_up if d.step >= spike - 5]
    assert late and all(d.missing == ["rules"] for d in late)
    assert [d.step for d in given_up] == list(range(len(given_up)))  # in step order, none twice
