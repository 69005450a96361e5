"""Admission at every hop: a record admitted costs no words, a refused one still says which it is."""

from __future__ import annotations

import sys

import pytest

import spikeguard.schemas.signing as signing
from spikeguard.components import build_stage, detector_stage
from spikeguard.errors import RecordBeyondRunClock, RecordOfOtherSession
from spikeguard.schemas import Decision, StepEvent, StepVerdicts, Topics, Verdict, new_session
from spikeguard.schemas.signing import sign
from spikeguard.settings import load_settings
from spikeguard.streaming.run_sessions import session_of

KEY = "admission-test-key-0123456789"
TOPICS = Topics("admission-test.")
EARLIER, LATER = new_session(now=1_000.0), new_session(now=2_000.0)


def _step(step: int, session: str | None = LATER) -> StepEvent:
    return StepEvent(
        run_id="r", session=session, step=step, time=1_000.0 + step, loss=1.0, grad_norm=1.0
    )


def _verdicts(step: int, session: str | None = LATER) -> StepVerdicts:
    verdict = Verdict(run_id="r", session=session, step=step, detector="rules", is_anomaly=False)
    return StepVerdicts(run_id="r", step=step, verdicts=[verdict])


def _decision(step: int, session: str | None = LATER) -> Decision:
    return Decision(
        decision_id=f"d-{step}", run_id="r", session=session, step=step, is_anomaly=False
    )


def _stages():
    settings = load_settings(env={})
    detectors = detector_stage("rules", settings, TOPICS)
    fusion = build_stage("fusion", settings, TOPICS)
    actuator = build_stage("actuator", settings, TOPICS)
    for stage in (detectors, fusion, actuator):
        stage.signing_key = KEY
    return (
        (detectors, TOPICS.steps, _step),
        (fusion, TOPICS.step_verdicts, _verdicts),
        (actuator, TOPICS.decisions, _decision),
    )


@pytest.mark.parametrize("hop", [0, 1, 2], ids=["detectors", "fusion", "actuator"])
def test_an_admitted_record_is_not_described_and_a_refused_one_says_which_it_is(monkeypatch, hop):
    stage, topic, make = _stages()[hop]
    described: list[object] = []
    real = signing.describe

    def counted(record):
        described.append(record)
        return real(record)

    # A stage's admission names the record through signing.describe, imported by name.
    monkeypatch.setattr(sys.modules[type(stage).admit.__module__], "describe", counted)
    for step in range(1, 50):
        stage.admit(topic, sign(make(step), KEY))
    assert described == []  # was two descriptions a record (one a record at the detectors)

    with pytest.raises(RecordOfOtherSession, match=r"run r: .*step 50.* is of session"):
        stage.admit(topic, sign(make(50, session=EARLIER), KEY))
    assert len(described) == 1


@pytest.mark.parametrize("hop", [1, 2], ids=["fusion", "actuator"])
def test_a_record_far_past_the_run_clock_is_refused_naming_it(hop):
    stage, topic, make = _stages()[hop]
    stage.admit(topic, sign(make(1), KEY))
    with pytest.raises(RecordBeyondRunClock, match=r"run r: .*step 10000000 is more than"):
        stage.admit(topic, sign(make(10_000_000), KEY))


def test_the_session_of_a_record_is_its_own_or_its_first_verdicts():
    assert session_of(_step(1)) == LATER
    assert session_of(_decision(1, session=None)) is None
    assert session_of(_verdicts(1)) == LATER  # StepVerdicts has no session field of its own
    assert session_of(_verdicts(1, session=None)) is None
    assert session_of(StepVerdicts.model_construct(run_id="r", step=1, verdicts=[])) is None
    assert session_of(object()) is None
