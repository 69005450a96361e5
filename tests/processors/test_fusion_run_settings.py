"""Fusion applies each run's own FusionConfig overrides from its RunEvent, on a real worker.

The stage's own threshold is 0.55; the run asks for 0.9. A statistical verdict
of confidence 0.7 is an anomaly under the first and not under the second.
"""

from __future__ import annotations

import time

from spikeguard.bus import EmbeddedBus
from spikeguard.components import build_stage
from spikeguard.schemas import (
    AnomalyType,
    DeadLetter,
    Decision,
    RunEvent,
    Topics,
    Verdict,
    decode,
    encode,
)
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

TOPICS = Topics("fusion-runs-test.")
DETECTORS = ("statistical", "rules", "ml", "predictor")


def make_worker(bus: EmbeddedBus) -> Worker:
    stage = build_stage("fusion", load_settings({"topic_prefix": TOPICS.prefix}, env={}), TOPICS)
    return Worker(bus, stage, snapshots=False)


def publish(bus: EmbeddedBus, worker: Worker, *events) -> None:
    producer = bus.producer()
    for topic, event in events:
        producer.publish(topic, encode(event), key=event.run_id)
    while worker.run_once(timeout=0):
        pass


def start(run_id: str, **fusion) -> tuple[str, RunEvent]:
    return TOPICS.runs, RunEvent(run_id=run_id, kind="start", fusion=fusion)


def step(run_id: str, s: int, confidence: float = 0.0, only: tuple[str, ...] = DETECTORS) -> list:
    out = []
    for name in only:
        flagged = name == "statistical" and confidence > 0
        out.append(
            (
                TOPICS.verdicts,
                Verdict(
                    run_id=run_id,
                    step=s,
                    detector=name,
                    is_anomaly=flagged,
                    confidence=confidence if flagged else 0.0,
                    type=AnomalyType.LOSS_SPIKE if flagged else AnomalyType.NONE,
                    loss=1.0,
                    grad_norm=1.0,
                ),
            )
        )
    return out


def decisions(bus: EmbeddedBus, run_id: str) -> dict[int, Decision]:
    found = [decode(r.value, Decision) for r in bus.read_all(TOPICS.decisions)]
    return {d.step: d for d in found if d.run_id == run_id}


def test_a_runs_threshold_applies_to_it_alone():
    bus = EmbeddedBus(partitions=2)
    worker = make_worker(bus)
    publish(bus, worker, start("strict", threshold=0.9), start("plain"))
    publish(bus, worker, *step("strict", 0, 0.7), *step("plain", 0, 0.7))
    assert decisions(bus, "plain")[0].is_anomaly
    assert not decisions(bus, "strict")[0].is_anomaly
    assert worker.stage.runs["strict"].config.threshold == 0.9
    assert worker.stage.runs["plain"].config.threshold == 0.55


def test_a_start_after_the_first_verdicts_applies_from_then_on_keeping_what_was_decided():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus)
    publish(bus, worker, *step("late", 0, 0.7))
    assert decisions(bus, "late")[
        0
    ].is_anomaly  # the stage's own threshold, the run's not known yet
    publish(bus, worker, start("late", threshold=0.9))
    publish(bus, worker, *step("late", 0))  # redelivered: already decided, not decided again
    publish(bus, worker, *step("late", 1, 0.7))
    got = decisions(bus, "late")
    assert sorted(got) == [0, 1] and not got[1].is_anomaly
    assert worker.stage.runs["late"].late_verdicts == 4


def test_bad_fusion_overrides_go_to_the_dlq_and_the_run_keeps_the_defaults():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus)
    publish(bus, worker, start("bad", threshold=7.0), start("typo", treshold=0.9))
    letters = [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]
    assert [x.error for x in letters] == ["RunSettingsRejected"] * 2
    assert "threshold" in letters[0].reason and "treshold" in letters[1].reason
    publish(bus, worker, *step("bad", 0, 0.7))
    assert decisions(bus, "bad")[0].is_anomaly


def test_an_end_waits_for_the_last_steps_decision_then_drops_the_run():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus)
    publish(bus, worker, start("r", threshold=0.9))
    publish(bus, worker, *step("r", 0), *step("r", 1, only=("rules", "statistical")))
    publish(bus, worker, (TOPICS.runs, RunEvent(run_id="r", kind="end", step=3)))
    assert "r" in worker.stage.runs  # steps 1 and 2 are not decided yet
    saved = worker.stage.snapshot(["r"])
    again = make_worker(EmbeddedBus(partitions=1)).stage
    again.restore(saved)  # a restart keeps the run's settings and its pending end
    assert again.runs["r"].config.threshold == 0.9 and again.ending.mark("r") == [0, 3]
    publish(bus, worker, *step("r", 1, only=("ml", "predictor")), *step("r", 2, 0.7))
    assert sorted(decisions(bus, "r")) == [0, 1, 2] and not decisions(bus, "r")[2].is_anomaly
    assert "r" not in worker.stage.runs


def test_an_end_whose_last_verdicts_never_come_flushes_after_the_grace():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus)
    publish(
        bus,
        worker,
        *step("r", 0, only=("rules",)),
        (TOPICS.runs, RunEvent(run_id="r", kind="end", step=1)),
    )
    stage = worker.stage
    assert "r" in stage.runs and decisions(bus, "r") == {}
    out = stage.tick(stage.ending.pending["r"][2] + stage.ending.grace_seconds)
    assert [d.step for _, d in out] == [0] and "r" not in stage.runs


def test_the_guards_plan_carries_fusion_overrides_under_policy_fusion_and_refuses_bad_ones():
    import pytest

    from spikeguard.errors import ConfigError
    from spikeguard.producers.config import GuardConfig
    from spikeguard.producers.run_plan import make_plan

    plan = make_plan(
        GuardConfig(), policy={"fusion": {"threshold": 0.9}, "spike_patience_steps": 4}
    )
    assert plan.fusion == {"threshold": 0.9} and plan.policy == {"spike_patience_steps": 4}
    with pytest.raises(ConfigError, match="FusionConfig"):
        make_plan(GuardConfig(), policy={"fusion": {"threshold": 7.0}})


def test_an_idle_run_evicted_with_a_step_still_pending_gets_that_decision_first():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus)
    publish(bus, worker, *step("quiet", 0, only=("rules",)))  # the other detectors never answer
    assert decisions(bus, "quiet") == {} and "quiet" in worker.stage.runs
    out = worker._evict_idle(time.time() + worker.run_idle_ttl_s + 1)
    assert [d.step for _, d in out] == [0]
    assert "quiet" not in worker.stage.runs
