"""With the run's key, every stage that reads the runs topic applies only the run events its Guard signed.

Real stages (built by name from settings, as the workers build them), real
Workers, the real embedded bus; records are published as bytes (as on Kafka),
so each consumer decodes and checks them itself. A forged start or end goes to
the DLQ with the reason and changes nothing: not the run's settings, not its
detector state.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import COMPONENTS, DETECTOR_NAMES, build_stage
from spikeguard.lab.simulate import generate
from spikeguard.metrics import Metrics
from spikeguard.processors.cohosted_stage import CoHostedDetectors
from spikeguard.schemas import (
    Action,
    ActionKind,
    AnomalyType,
    CheckpointEvent,
    DeadLetter,
    Decision,
    Evidence,
    RunEvent,
    StepEvent,
    Topics,
    Verdict,
    decision_id,
    decode,
    encode,
    sign_step,
)
from spikeguard.schemas.signing import sign, sign_run_event
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

KEY = "runs-key-0123456789abcdef"
OTHER_KEY = "someone-elses-key-0123456789"
TOPICS = Topics("runauth.")
RUN = "r1"


def make_worker(bus: EmbeddedBus, name: str, key: str | None = KEY, **settings) -> Worker:
    values = {"topic_prefix": TOPICS.prefix, **settings}
    if key is not None:
        values["signing_key"] = key
    stage = build_stage(name, load_settings(values, env={}), TOPICS)
    return Worker(bus, stage, metrics=Metrics(CollectorRegistry()), snapshots=False)


def publish(bus: EmbeddedBus, workers: list[Worker], *events) -> None:
    producer = bus.producer()
    for topic, event in events:
        producer.publish(topic, encode(event), key=event.run_id)
        # The runs topic is compacted (a newer record of a key replaces the older at once):
        # the workers read each record before the next is published.
        while sum(w.run_once(timeout=0) for w in workers):
            pass


def letters(bus: EmbeddedBus) -> list[DeadLetter]:
    return [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]


def run_event(kind: str, key: str | None = KEY, **fields) -> tuple[str, RunEvent]:
    event = RunEvent(run_id=RUN, kind=kind, **fields)
    return TOPICS.runs, event if key is None else sign_run_event(event, key)


def signed_steps(n: int, start: int = 0) -> list[tuple[str, StepEvent]]:
    events = generate("sudden_spike", 400, 3, run_id=RUN).events[
        start : start + n
    ]  # a spike at step 211
    return [(TOPICS.steps, sign_step(e, KEY)) for e in events]


# -- detectors: a forged end would drop the run's state ------------------------------------------
@pytest.mark.parametrize("forged_key", [None, OTHER_KEY], ids=["unsigned", "other-key"])
def test_a_forged_end_leaves_the_detectors_state_and_its_verdicts_unchanged(forged_key):
    bus, control = EmbeddedBus(partitions=1), EmbeddedBus(partitions=1)
    worker, reference = make_worker(bus, "statistical"), make_worker(control, "statistical")
    publish(bus, [worker], *signed_steps(200))
    publish(control, [reference], *signed_steps(200))
    before = worker.stage.runs[RUN].state_dict()

    publish(bus, [worker], run_event("end", forged_key, step=200, finished=True))

    (letter,) = letters(bus)
    assert letter.source_topic == TOPICS.runs and letter.error == "RunEventNotAuthenticated"
    problem = "no signature" if forged_key is None else "bad signature"
    assert f"run {RUN} end: {problem}" in letter.reason and "unchanged" in letter.reason
    assert worker.stage.runs[RUN].state_dict() == before
    # The rest of the run (a spike among it) is judged exactly as if nothing had been forged.
    publish(bus, [worker], *signed_steps(200, start=200))
    publish(control, [reference], *signed_steps(200, start=200))
    judged = [
        decode(r.value, Verdict).model_dump(exclude={"time"}) for r in bus.read_all(TOPICS.verdicts)
    ]
    expected = [
        decode(r.value, Verdict).model_dump(exclude={"time"})
        for r in control.read_all(TOPICS.verdicts)
    ]
    assert judged == expected and any(v["is_anomaly"] for v in judged[200:])


def test_the_runs_own_signed_end_ends_it():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus, "statistical")
    publish(bus, [worker], *signed_steps(50), run_event("end", step=50, finished=True))
    assert RUN not in worker.stage.runs and letters(bus) == []


def test_cohosted_detectors_refuse_a_forged_end_once_and_all_keep_the_run():
    bus = EmbeddedBus(partitions=1)
    settings = load_settings({"topic_prefix": TOPICS.prefix, "signing_key": KEY}, env={})
    stage = CoHostedDetectors([build_stage(name, settings, TOPICS) for name in DETECTOR_NAMES])
    worker = Worker(bus, stage, metrics=Metrics(CollectorRegistry()), snapshots=False)
    publish(bus, [worker], *signed_steps(40), run_event("end", None, step=40))
    assert [l.error for l in letters(bus)] == ["RunEventNotAuthenticated"]
    assert all(RUN in hosted.runs for hosted in stage.stages)


# -- fusion: a forged start would change how verdicts weigh --------------------------------------
def verdicts_of(step: int, confidence: float) -> list[tuple[str, Verdict]]:
    # Signed, as the detector workers sign theirs: fusion with a key takes no others.
    return [
        (
            TOPICS.verdicts,
            sign(
                Verdict(
                    run_id=RUN,
                    step=step,
                    detector=name,
                    is_anomaly=name == "statistical",
                    confidence=confidence if name == "statistical" else 0.0,
                    type=AnomalyType.LOSS_SPIKE if name == "statistical" else AnomalyType.NONE,
                    loss=1.0,
                    grad_norm=1.0,
                ),
                KEY,
            ),
        )
        for name in DETECTOR_NAMES
    ]


def test_fusion_applies_the_runs_signed_overrides_and_refuses_forged_ones():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus, "fusion")
    publish(bus, [worker], run_event("start", fusion={"threshold": 0.6}))
    assert worker.stage.run(RUN).config.threshold == 0.6  # the run's own
    # Forged: a threshold no verdict reaches, and weights of nothing.
    disarm = {"threshold": 1.0, "weights": {"statistical": 0.0}, "default_weight": 0.0}
    publish(
        bus,
        [worker],
        run_event("start", None, fusion=disarm),
        run_event("start", OTHER_KEY, fusion=disarm),
    )
    reasons = [l.reason for l in letters(bus)]
    assert (
        len(reasons) == 2
        and "start: no signature" in reasons[0]
        and "start: bad signature" in reasons[1]
    )
    assert worker.stage.run(RUN).config.threshold == 0.6
    publish(bus, [worker], *verdicts_of(0, 0.7))
    (decision,) = [decode(r.value, Decision) for r in bus.read_all(TOPICS.decisions)]
    assert decision.is_anomaly  # 0.7 >= the run's 0.6


# -- the actuator: a forged start would choose a policy that never rolls back --------------------
def decision(step: int, anomaly: bool = False) -> tuple[str, Decision]:
    fields = (
        dict(
            is_anomaly=True,
            critical=True,
            type=AnomalyType.NON_FINITE,
            confidence=1.0,
            incident_id=f"i{step}",
            incident_onset_step=step,
        )
        if anomaly
        else dict(is_anomaly=False)
    )
    # Signed, as fusion signs its decisions: the actuator with a key takes no others.
    return TOPICS.decisions, sign(
        Decision(
            decision_id=decision_id(RUN, step),
            run_id=RUN,
            step=step,
            evidence=Evidence(step=step, loss=math.nan if anomaly else 1.0, grad_norm=1.0),
            **fields,
        ),
        KEY,
    )


def test_the_actuator_applies_the_runs_signed_policy_and_refuses_a_forged_one():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus, "actuator")
    cadence = dict(checkpoint_every=20, keep_checkpoints=4, detection_delay_steps=10)
    publish(bus, [worker], run_event("start", preset="small", **cadence))
    assert worker.stage.run(RUN).config.rollback_min_steps_before_onset == 30  # the small preset's
    publish(
        bus,
        [worker],
        run_event("start", None, policy={"rollback_min_steps_before_onset": 1_000_000}),
        run_event("start", OTHER_KEY, policy={"rollback_min_steps_before_onset": 1_000_000}),
        run_event("end", None, step=21),
    )
    assert [l.reason.split(":")[0] for l in letters(bus)] == [f"run {RUN} start"] * 2 + [
        f"run {RUN} end"
    ]
    assert worker.stage.run(RUN).config.rollback_min_steps_before_onset == 30
    assert not worker.stage.ending.pending  # the forged end is not waiting to end the run either
    publish(
        bus,
        [worker],
        (
            TOPICS.checkpoints,
            sign(CheckpointEvent(run_id=RUN, step=20, checkpoint_id="c20", healthy=True), KEY),
        ),
        *[decision(s) for s in range(21, 60)],
        decision(60, anomaly=True),
        decision(61, anomaly=True),
    )
    actions = [decode(r.value, Action) for r in bus.read_all(TOPICS.actions)]
    rollback = next(a for a in actions if a.kind is ActionKind.ROLLBACK)
    assert rollback.params.target_step == 20 and rollback.signature


# -- every stage, with and without a key ---------------------------------------------------------
@pytest.mark.parametrize("name", COMPONENTS)
def test_every_stage_that_reads_the_runs_topic_checks_it_with_a_key_and_not_without(name):
    keyed, keyless = EmbeddedBus(partitions=1), EmbeddedBus(partitions=1)
    with_key, without = make_worker(keyed, name), make_worker(keyless, name, key=None)
    assert TOPICS.runs in with_key.stage.inputs()
    for bus, worker in ((keyed, with_key), (keyless, without)):
        publish(
            bus,
            [worker],
            run_event("start", None),
            run_event("start", OTHER_KEY, reason="x"),
            run_event("start"),
        )
    assert [l.error for l in letters(keyed)] == ["RunEventNotAuthenticated"] * 2
    assert (
        letters(keyless) == []
    )  # --insecure, backtests and replays: taken as they come, as before
