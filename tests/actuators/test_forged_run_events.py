"""Forged run events cannot switch a run's protection off (the runs topic is signed), on the real closed loop.

The compacted ``runs`` topic carries a run's start and end with the settings
the pipeline applies to it: fusion's overrides, the actuator's policy, and the
end that drops the run's detector state. Whoever can write that topic could
otherwise give a run they do not own weights that never flag a spike and a
policy that never rolls back. With a key, the Guard signs its run events and
every stage that reads them refuses the rest to the DLQ with the reason.

A real model trains on the embedded runtime through a real loss spike while a
forger writes, for its run, an unsigned start that would disarm fusion and the
actuator, and a start signed with another key.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from prometheus_client import CollectorRegistry

from spikeguard.metrics import Metrics
from spikeguard.producers import Guard
from spikeguard.producers.config import GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.schemas import DeadLetter, RunEvent, decode, encode
from spikeguard.schemas.signing import sign_run_event
from spikeguard.settings import load_settings

STEPS = 260
BAD_BATCHES = range(150, 158)  # global batch indices whose labels are garbage: a real spike
FORGE_AT = 40  # the trainer's step at which the forged starts are written (after the genuine one)
RUN = "victim"
# Within every validated range, and together they disarm the run: no detector's anomaly
# weighs anything in fusion, and no checkpoint is ever far enough back for a rollback.
DISARMED = dict(
    fusion={"weights": {"statistical": 0.0, "rules": 0.0, "ml": 0.0}, "default_weight": 0.0},
    policy={"rollback_min_steps_before_onset": 1_000_000},
)


def forged_start(**fields) -> RunEvent:
    return RunEvent(run_id=RUN, kind="start", step=FORGE_AT, **{**DISARMED, **fields})


def until_refused(bus, topics, count: int, within_s: float = 60.0) -> None:
    """Wait until ``count`` run events are dead letters (a bound on a hung pipeline, not a speed check)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        letters = [decode(r.value, DeadLetter) for r in bus.read_all(topics.dlq)]
        if sum(l.source_topic == topics.runs for l in letters) >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"fewer than {count} run events refused within {within_s} s")


@pytest.mark.parametrize("child", [False, True], ids=["threads", "child-process"])
def test_forged_run_starts_are_refused_by_every_stage_and_the_run_still_rolls_back(
    tmp_path, regression_loader, spiked_step, child
):
    # child-process: the Guard's signed run events and the forgeries cross the bridge to the
    # workers in another interpreter, and their dead letters come back.
    settings = load_settings(
        {
            "topic_prefix": f"forgedrun-{uuid.uuid4().hex[:8]}.",
            "worker": {"embedded_process": child},
        },
        env={},
    )
    with open_runtime(settings, metrics=Metrics(CollectorRegistry())) as runtime:
        bus, topics = runtime.bus, runtime.topics
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        config = GuardConfig(
            checkpoint_dir=str(tmp_path),
            checkpoint_every=20,
            keep_checkpoints=8,
            lockstep=True,
            lockstep_timeout=30.0,
            data_seed=0,
            resume=False,
        )
        guard = Guard(model, optimizer, run_id=RUN, config=config, runtime=runtime)
        forger = bus.producer()
        for x, y in guard.data(regression_loader(4096), epochs=10, max_steps=STEPS):
            if guard.generation == 0 and guard.step_count == FORGE_AT:
                forger.publish(topics.runs, encode(forged_start()), key=RUN)
                # The runs topic is compacted: the next record of the key replaces this one at
                # once, so the second forgery waits until every stage has read (and refused) it.
                until_refused(bus, topics, 3)  # every stage reading runs
                forger.publish(
                    topics.runs,
                    encode(sign_run_event(forged_start(reason="other key"), "not-the-runs-key")),
                    key=RUN,
                )
            spiked_step(guard, model, optimizer, x, y, BAD_BATCHES)
        stages = {w.stage.name: w.stage for w in runtime.workers}  # none here with a child process
        applied = (
            None
            if child
            else (
                stages["fusion"].run(RUN).config.weights,
                stages["actuator"].run(RUN).config.rollback_min_steps_before_onset,
            )
        )
        guard.close()
        letters = [decode(r.value, DeadLetter) for r in bus.read_all(topics.dlq)]
        ends = [
            e
            for e in (decode(r.value, RunEvent) for r in bus.read_all(topics.runs))
            if e.kind == "end"
        ]

    # The Guard signs its run events; every stage applied its start (no overrides: the defaults)
    # and refused nothing of it (only the forged two are dead letters below).
    assert [e.reason for e in ends] == ["finished"] and ends[0].signature
    if not child:
        assert applied == (settings.fusion.weights, settings.policy.rollback_min_steps_before_onset)
    # Each forged start went to the DLQ from every stage that reads the runs topic, with the reason.
    refused = [(l.consumer, l.reason) for l in letters if l.source_topic == topics.runs]
    consumers = {c.removeprefix(topics.prefix) for c, _ in refused}
    # (the embedded runtime co-hosts the four detectors behind one consumer: three stages)
    assert consumers == {"detectors", "fusion", "actuator"}, refused
    assert len(refused) == 2 * 3
    assert all(
        l.error == "RunEventNotAuthenticated" for l in letters if l.source_topic == topics.runs
    )
    assert sum(f"run {RUN} start: no signature" in r for _, r in refused) == 3
    assert sum(f"run {RUN} start: bad signature" in r for _, r in refused) == 3
    # And the real spike was answered as the run's own settings say: one rollback, applied.
    assert guard.generation >= 1 and not guard.should_stop and guard.step_count == STEPS
    assert guard.counters["rollbacks"] == 1
