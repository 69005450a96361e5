"""A step's verdicts as one record (StepVerdicts): the wire, its signature, and fusion reading it.

Real detectors, fusion and actuator in real Workers on the real embedded bus;
every record crosses the bus as bytes, as on Kafka.
"""

from __future__ import annotations

import json
import math

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import DETECTOR_NAMES, build_stage
from spikeguard.errors import MalformedMessage
from spikeguard.lab.backtest import run_offline
from spikeguard.lab.simulate import generate
from spikeguard.metrics import Metrics
from spikeguard.processors.cohosted_stage import CoHostedDetectors
from spikeguard.schemas import (
    DeadLetter,
    Decision,
    StepEvent,
    StepVerdicts,
    Topics,
    Verdict,
    decode,
    decode_any,
    encode,
    sign_step,
)
from spikeguard.schemas.signing import sign, signature_problem
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker


from .test_step_authentication import drain

KEY = "step-verdicts-key-0123456789abcdef"
TOPICS = Topics("stepverdicts.")
SETTINGS = load_settings({"topic_prefix": TOPICS.prefix, "signing_key": KEY}, env={})


def steps() -> list[StepEvent]:
    """Two interleaved runs, one with a spike, one diverging, signed as their trainers sign them."""
    runs = [
        generate(kind, 300, seed, run_id=f"run-{kind}").events
        for seed, kind in ((1, "sudden_spike"), (2, "non_finite"))
    ]
    return [sign_step(e, KEY) for pair in zip(*runs) for e in pair]


def step_verdicts(step: int = 7, detectors=DETECTOR_NAMES, **change) -> StepVerdicts:
    made = [
        Verdict(
            run_id="r1",
            step=step,
            detector=name,
            is_anomaly=name == "rules",
            confidence=0.5,
            loss=math.nan if name == "rules" else 2.0,
            signals={"z": math.inf},
        )
        for name in detectors
    ]
    return StepVerdicts(**{"run_id": "r1", "step": step, "verdicts": made, **change})


def unsigned(decisions) -> dict[str, str]:
    """decision_id -> the decision's JSON without its signature (at-least-once: duplicates agree)."""
    found: dict[str, str] = {}
    for d in decisions:
        text = json.dumps(d.model_dump(mode="json", exclude={"signature"}), sort_keys=True)
        assert found.setdefault(d.decision_id, text) == text
    return found


def decisions(bus: EmbeddedBus) -> dict[str, str]:
    return unsigned(decode(r.value, Decision) for r in bus.read_all(TOPICS.decisions))


def pipeline(events: list[StepEvent], cohosted: bool) -> EmbeddedBus:
    """Detectors (four workers, or one co-hosting them) and fusion on one bus, steps as bytes."""
    bus = EmbeddedBus(partitions=2)
    producer = bus.producer()
    for event in events:
        producer.publish(TOPICS.steps, encode(event), key=event.run_id)
    detectors = [build_stage(name, SETTINGS, TOPICS) for name in DETECTOR_NAMES]
    stages = [CoHostedDetectors(detectors)] if cohosted else detectors
    workers = [
        Worker(bus, stage, snapshots=False, metrics=Metrics(CollectorRegistry()))
        for stage in [*stages, build_stage("fusion", SETTINGS, TOPICS)]
    ]
    drain(workers)
    return bus


def test_a_step_verdicts_record_round_trips_exactly_with_its_signature():
    record = sign(step_verdicts(), KEY)
    back = decode(encode(record), StepVerdicts)
    assert encode(back) == encode(record)  # NaN and Infinity travel as strings and come back
    assert math.isnan(back.verdicts[1].loss) and back.verdicts[0].signals["z"] == math.inf
    assert signature_problem(back, KEY) is None  # a decoded twin, checked in full
    assert isinstance(decode_any(encode(record)), StepVerdicts)


def test_a_step_verdicts_record_is_refused_unsigned_altered_or_under_another_key():
    assert "no signature" in signature_problem(step_verdicts(), KEY)
    signed = sign(step_verdicts(), KEY)
    flipped = [
        v.model_copy(update={"is_anomaly": not v.is_anomaly}) if v.detector == "rules" else v
        for v in signed.verdicts
    ]
    altered = decode(encode(signed.model_copy(update={"verdicts": flipped})), StepVerdicts)
    assert "bad signature" in signature_problem(altered, KEY)
    assert "bad signature" in signature_problem(
        decode(encode(signed), StepVerdicts), "another-key-0123456789"
    )


@pytest.mark.parametrize(
    "change, why",
    [
        ({"step": 8}, "not the record's run r1 step 8"),
        ({"verdicts": []}, "at least 1 item"),
    ],
)
def test_a_step_verdicts_record_of_another_step_or_empty_is_malformed(change, why):
    made = step_verdicts().model_dump(mode="json")
    made.update({k: v for k, v in change.items()})
    with pytest.raises(MalformedMessage, match=why):
        decode(json.dumps(made), StepVerdicts)
    twice = step_verdicts().model_dump(mode="json")
    twice["verdicts"].append(twice["verdicts"][0])
    with pytest.raises(MalformedMessage, match="two verdicts of detector statistical"):
        decode(json.dumps(twice), StepVerdicts)


def test_cohosted_detectors_send_one_signed_record_per_step_and_fusion_decides_as_the_backtest():
    # The backtest hands fusion each step's verdicts together, in detector order: a step's
    # record, read in its order, is the same input, so the live decisions are the backtest's
    # (a critical verdict decides with the verdicts before it, as there).
    events = steps()
    together = pipeline(events, cohosted=True)

    packed = [decode(r.value, StepVerdicts) for r in together.read_all(TOPICS.step_verdicts)]
    assert not together.read_all(TOPICS.verdicts)  # no verdict travelled alone
    assert len({(p.run_id, p.epoch, p.step) for p in packed}) == len(events)
    assert all([v.detector for v in p.verdicts] == list(DETECTOR_NAMES) for p in packed)
    assert all(
        signature_problem(p, KEY) is None and p.verdicts[0].signature is None for p in packed
    )
    assert not together.read_all(TOPICS.dlq)

    offline = run_offline(
        [(TOPICS.steps, e) for e in events],
        SETTINGS,
        [*DETECTOR_NAMES, "fusion"],
        {TOPICS.decisions: Decision},
    )[TOPICS.decisions]
    expected, got = unsigned(offline), decisions(together)
    assert got == expected
    assert len(got) == len(events)
    assert {json.loads(t)["type"] for t in got.values()} >= {"loss_spike", "non_finite"}


def test_fusion_refuses_an_unsigned_step_verdicts_record_to_the_dlq_and_decides_nothing_from_it():
    bus = EmbeddedBus(partitions=1)
    fusion = Worker(
        bus,
        build_stage("fusion", SETTINGS, TOPICS),
        snapshots=False,
        metrics=Metrics(CollectorRegistry()),
    )
    producer = bus.producer()
    producer.publish(TOPICS.step_verdicts, encode(step_verdicts(step=0)), key="r1")  # unsigned
    producer.publish(
        TOPICS.step_verdicts,
        encode(sign(step_verdicts(step=1), "not-the-key-0123456789")),
        key="r1",
    )
    drain([fusion])
    letters = [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]
    assert [letter.error for letter in letters] == ["RecordNotAuthenticated"] * 2
    assert "no signature" in letters[0].reason and "bad signature" in letters[1].reason
    assert not bus.read_all(TOPICS.decisions)


def test_per_detector_verdicts_still_decide_next_to_step_verdicts_records():
    # Three detectors co-hosted, the fourth as its own worker (one Verdict per record):
    # fusion reads both topics and decides every step with all four verdicts.
    bus = EmbeddedBus(partitions=1)
    fusion = Worker(
        bus,
        build_stage("fusion", SETTINGS, TOPICS),
        snapshots=False,
        metrics=Metrics(CollectorRegistry()),
    )
    producer = bus.producer()
    *hosted, alone = DETECTOR_NAMES
    for step in range(3):
        producer.publish(
            TOPICS.step_verdicts, encode(sign(step_verdicts(step, hosted), KEY)), key="r1"
        )
        (verdict,) = step_verdicts(step, [alone]).verdicts
        producer.publish(TOPICS.verdicts, encode(sign(verdict, KEY)), key="r1")
    drain([fusion])
    decided = sorted(
        (decode(r.value, Decision) for r in bus.read_all(TOPICS.decisions)), key=lambda d: d.step
    )
    assert [d.step for d in decided] == [0, 1, 2]
    assert all(set(d.detectors) == set(DETECTOR_NAMES) and not d.missing for d in decided)
    assert not bus.read_all(TOPICS.dlq)
