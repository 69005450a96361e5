"""The embedded pipeline in a child process (``worker.embedded_process``), bridged to the trainer's bus.

A real model trains through a persistent loss spike with the pipeline in a
child process: the rollback comes back over the bridge, is applied and acked;
forged steps still land in the DLQ (now the child's, bridged back); the
trainer's process runs no worker thread; closing the runtime stops the child.
The trainer's own steps go down as fields (built and signed in the child);
a guard with another key gets no such favour; fields that make no step go to
the DLQ; a child that dies is reported and training goes on; a burst crosses
the bridge as one message.
"""

from __future__ import annotations

import math
import os
import threading
import uuid

import pytest
import torch

from spikeguard.bus import Record
from spikeguard.producers import Guard
from spikeguard.producers.config import GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.schemas import (
    Ack,
    AckStatus,
    Action,
    ActionKind,
    DeadLetter,
    Decision,
    StepEvent,
    Topics,
    decode,
    encode,
)
from spikeguard.schemas.signing import verify_action
from spikeguard.settings import load_settings

STEPS = 480
BAD_BATCHES = range(398, 406)


def settings(**extra):
    return load_settings(
        {
            "topic_prefix": f"child-{uuid.uuid4().hex[:8]}.",
            "worker": {"embedded_process": True},
            **extra,
        },
        env={},
    )


def test_a_spike_is_rolled_back_by_the_pipeline_in_a_child_process(
    tmp_path, regression_loader, spiked_step
):
    # (other tests' runtimes may have left daemon threads behind: only new ones count)
    before = {t.ident for t in threading.enumerate()}
    runtime = open_runtime(settings())
    try:
        assert runtime.workers == [] and runtime.threads == []  # no pipeline thread in this process
        assert not [
            t for t in threading.enumerate() if t.name == "spikeguard-ml" and t.ident not in before
        ]
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        config = GuardConfig(
            checkpoint_dir=str(tmp_path),
            lockstep=True,
            lockstep_timeout=30.0,
            data_seed=0,
            resume=False,
        )
        guard = Guard(model, optimizer, run_id="child", config=config, runtime=runtime)
        for x, y in guard.data(regression_loader(), epochs=10, max_steps=STEPS):
            spiked_step(guard, model, optimizer, x, y, BAD_BATCHES)
        guard.close()
        bus, topics = runtime.bus, runtime.topics
        actions = [decode(r.value, Action) for r in bus.read_all(topics.actions)]
        acks = [decode(r.value, Ack) for r in bus.read_all(topics.acks)]
        decisions = [decode(r.value, Decision) for r in bus.read_all(topics.decisions)]
    finally:
        runtime.close()
    rollbacks = [a for a in actions if a.kind is ActionKind.ROLLBACK]
    assert rollbacks and all(verify_action(a, runtime.settings.signing_key) for a in actions)
    assert any(a.kind is ActionKind.ROLLBACK and a.status is AckStatus.APPLIED for a in acks)
    assert guard.generation >= 1
    # Lockstep: every step was decided (in the child) and the decision came back here.
    assert {d.step for d in decisions if d.epoch == 0} >= set(range(0, BAD_BATCHES[0]))
    child = next(c.__self__ for c in runtime.closers if hasattr(c, "__self__"))
    assert child.process.returncode == 0


def test_forged_steps_still_land_in_the_dlq_across_the_bridge():
    runtime = open_runtime(settings())
    try:
        bus, topics = runtime.bus, runtime.topics
        producer = bus.producer()
        forged = [
            StepEvent(
                run_id="victim", step=s, time=1000.0 + s, loss=math.nan, grad_norm=math.nan, lr=1e-3
            )
            for s in range(3)
        ]
        for event in forged:  # the object itself too, as an in-process forger could hand it over
            producer.publish(topics.steps, encode(event), key=event.run_id, event=event)
        producer.flush()
        dead: list[DeadLetter] = []
        for _ in range(600):  # a bound on polling, not a timing assertion
            dead = [decode(r.value, DeadLetter) for r in bus.read_all(topics.dlq)]
            if len(dead) >= 3:
                break
            threading.Event().wait(0.1)
        refused = sorted(
            (d.consumer.rsplit(".", 1)[1], decode(d.value, StepEvent).step) for d in dead
        )
        # The four detectors share one consumer (components.EMBEDDED_COMPONENTS): refused once.
        assert refused == [("detectors", s) for s in range(3)]
        assert {d.error for d in dead} == {"StepNotAuthenticated"}
        assert bus.read_all(topics.actions) == []
    finally:
        runtime.close()


def test_the_default_embedded_runtime_runs_the_pipeline_in_a_child_process():
    runtime = open_runtime(load_settings({"topic_prefix": f"dflt-{uuid.uuid4().hex[:8]}."}, env={}))
    try:
        assert runtime.child is not None and runtime.child.problem is None
        assert runtime.workers == [] and runtime.threads == []
    finally:
        runtime.close()
    assert runtime.child.process.returncode == 0


def _session(data_dir, prefix, tmp_path, steps):
    """One trainer session on ``data_dir``: open, train ``steps`` more steps of run "durable", close."""
    runtime = open_runtime(
        load_settings({"topic_prefix": prefix, "data_dir": str(data_dir)}, env={})
    )
    try:
        assert runtime.child is not None  # the default: the pipeline in a child process
        model, optimizer, x, y = _tiny()
        config = GuardConfig(
            checkpoint_dir=str(tmp_path / "ckpt"),
            checkpoint_every=10,
            resume=True,
        )
        guard = Guard(
            model,
            optimizer,
            run_id="durable",
            config=config,
            runtime=runtime,
        )
        first = guard.step_count
        _train(guard, model, optimizer, x, y, steps)
        bus, topics = runtime.bus, runtime.topics
        assert _wait_for(
            lambda: (
                {
                    d.step
                    for d in (decode(r.value, Decision) for r in bus.read_all(topics.decisions))
                }
                >= set(range(first, first + steps))
            )
        )
        guard.close()
    finally:
        runtime.close()
    assert runtime.child.problem is None and runtime.child.process.returncode == 0
    return first


def test_data_dir_state_survives_a_restart_with_the_pipeline_in_a_child_process(tmp_path):
    from spikeguard.bus import EmbeddedBus
    from spikeguard.reporting.recorded_settings import load as recorded

    data_dir, prefix = tmp_path / "bus", f"durable-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    assert _session(data_dir, prefix, tmp_path, 40) == 0
    saved = EmbeddedBus(data_dir=data_dir)
    # The child recorded the whole pipeline: the trainer's steps, the decisions, the workers' state.
    assert sorted(decode(r.value, StepEvent).step for r in saved.read_all(topics.steps)) == list(
        range(40)
    )
    assert saved.read_all(topics.state("detectors"))
    saved.close()
    assert _session(data_dir, prefix, tmp_path, 20) == 40  # the Guard resumed from its checkpoint
    reopened = EmbeddedBus(data_dir=data_dir)
    decided = [decode(r.value, Decision).step for r in reopened.read_all(topics.decisions)]
    # The second session's workers went on from the committed offsets: no step judged twice,
    # none of the first session's steps judged again, every step of both judged.
    assert sorted(decided) == list(range(60))
    assert recorded(data_dir)  # the judging settings, for a later replay


def _wait_for(check, rounds=600):
    """Poll ``check()`` until it is truthy (a bound on polling, not a timing assertion)."""
    for _ in range(rounds):
        found = check()
        if found:
            return found
        threading.Event().wait(0.1)
    return check()


def _tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return (
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        torch.randn(32, 8),
        torch.randn(32, 1),
    )


def _guarded(runtime, tmp_path, run_id, key=None):
    """A tiny model's Guard on ``runtime`` (signing with the pipeline's key unless ``key``)."""
    model, optimizer, x, y = _tiny()
    config = GuardConfig(
        checkpoint_dir=str(tmp_path),
        checkpoint_every=0,
        resume=False,
        signing_key=key if key is not None else runtime.settings.signing_key,
    )
    guard = Guard(model, optimizer, run_id=run_id, config=config, runtime=runtime)
    return guard, model, optimizer, x, y


def _train(guard, model, optimizer, x, y, steps):
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        guard.step(loss)


def test_the_trainers_steps_go_down_as_fields_and_are_built_and_signed_in_the_child(tmp_path):
    from spikeguard.runtime.child import PendingStep
    from spikeguard.schemas.signing import VERIFIED_STEPS, step_signature_problem

    runtime = open_runtime(settings())
    try:
        guard, model, optimizer, x, y = _guarded(runtime, tmp_path, "fields")
        _train(guard, model, optimizer, x, y, 60)
        guard.publisher.flush(10.0)
        bus, topics = runtime.bus, runtime.topics
        decided = _wait_for(
            lambda: (
                {
                    d.step
                    for d in (decode(r.value, Decision) for r in bus.read_all(topics.decisions))
                    if d.run_id == "fields"
                }
                >= set(range(60))
            )
        )
        # The trainer's process neither built nor signed a step event: each went down as its
        # fields, and the child made, signed and judged it.
        assert decided
        assert not [
            e
            for e, _ in VERIFIED_STEPS._marks.values()
            if e.run_id == "fields" and type(e) is StepEvent
        ]
        held = bus.read_all(topics.steps)
        assert len(held) == 60 and {type(r) for r in held} == {PendingStep}
        # Read here, a step is built and signed on demand, as the child made it.
        steps = [r.decoded(StepEvent) for r in held]
        assert sorted(s.step for s in steps) == list(range(60))
        assert all(
            step_signature_problem(decode(encode(s), StepEvent), runtime.settings.signing_key)
            is None
            for s in steps
        )
        assert guard.publisher.sent >= 60 and guard.publisher.failed == 0
        assert bus.read_all(topics.dlq) == []
        guard.close()
    finally:
        runtime.close()
    assert runtime.child.problem is None and runtime.child.process.returncode == 0


def test_a_guard_with_another_key_is_not_vouched_for_by_the_child(tmp_path):
    from pydantic import SecretStr

    runtime = open_runtime(settings())
    try:
        stranger = SecretStr("not the pipeline's key, not at all")
        guard, model, optimizer, x, y = _guarded(runtime, tmp_path, "stranger", key=stranger)
        _train(guard, model, optimizer, x, y, 3)
        guard.publisher.flush(10.0)
        bus, topics = runtime.bus, runtime.topics

        # Its steps are published (signed with its own key) as before, and refused as before.
        def letters(topic):
            return [
                d
                for d in (decode(r.value, DeadLetter) for r in bus.read_all(topics.dlq))
                if d.source_topic == topic
            ]

        dead = _wait_for(lambda: letters(topics.steps) if len(letters(topics.steps)) >= 3 else None)
        assert len(bus.read_all(topics.steps)) == 3
        assert {d.error for d in dead} == {"StepNotAuthenticated"}
        assert sorted({decode(d.value, StepEvent).step for d in dead}) == [0, 1, 2]
        # So is its run start (signed with its key too), by all three workers (the detectors
        # co-hosted, fusion, the actuator): its settings apply to nothing.
        runs = _wait_for(lambda: letters(topics.runs) if len(letters(topics.runs)) >= 3 else None)
        assert {d.error for d in runs} == {"RunEventNotAuthenticated"} and len(runs) == 3
        guard.close()
    finally:
        runtime.close()


def test_fields_that_make_no_step_go_to_the_dlq_and_the_child_goes_on():
    runtime = open_runtime(settings())
    try:
        bus, topics, child = runtime.bus, runtime.topics, runtime.child
        key = runtime.settings.signing_key
        assert child.ship_fields(topics.steps, [dict(run_id="bad", step=-1, loss=1.0)], key)
        assert child.ship_fields(topics.steps, [dict(run_id="good", step=0, loss=1.0)], key)
        dead = _wait_for(lambda: [decode(r.value, DeadLetter) for r in bus.read_all(topics.dlq)])
        assert [(d.error, d.key, d.consumer) for d in dead] == [
            ("ValidationError", "bad", "spikeguard.bridge")
        ]
        assert "step" in dead[0].reason
        assert _wait_for(
            lambda: [
                r
                for r in bus.read_all(topics.decisions)
                if decode(r.value, Decision).run_id == "good"
            ]
        )
        # Not for another topic, nor with another key: those the child does not take.
        assert not child.ship_fields(topics.acks, [dict(run_id="good", step=1, loss=1.0)], key)
        assert not child.ship_fields(topics.steps, [dict(run_id="good", step=1, loss=1.0)], "other")
    finally:
        runtime.close()


def test_a_child_that_dies_is_reported_and_training_goes_on(tmp_path, caplog):
    runtime = open_runtime(settings())
    try:
        guard, model, optimizer, x, y = _guarded(runtime, tmp_path, "orphan")
        _train(guard, model, optimizer, x, y, 20)
        runtime.child.process.kill()
        assert _wait_for(lambda: runtime.child.problem)
        _train(guard, model, optimizer, x, y, 30)  # no exception: the local protections go on
        assert guard.step_count == 50
        guard.publisher.flush(10.0)
        # After the loss, steps are built here again and land on the trainer's bus.
        published = [r for r in runtime.bus.read_all(runtime.topics.steps) if type(r) is Record]
        assert {decode(r.value, StepEvent).step for r in published} >= set(range(21, 50))
        guard.close()
    finally:
        runtime.close()
    assert "exited with code -9" in runtime.child.problem
    assert [
        r
        for r in caplog.records
        if r.levelname == "ERROR"
        and "exited with code -9" in r.getMessage()
        and "local protections" in r.getMessage()
    ]


def test_a_burst_of_records_crosses_the_bridge_in_one_message():
    from multiprocessing import Pipe

    from spikeguard.bus import EmbeddedBus
    from spikeguard.runtime.child import RECORDS, Forwarder, Link

    bus, topics = EmbeddedBus(partitions=1), Topics()
    bus.create_topics([topics.decisions])
    read, write = Pipe(duplex=False)
    forwarder = Forwarder(
        bus, [topics.decisions], "bridge", Link(write), linger_s=0.001, max_linger_s=0.5
    )
    producer = bus.producer()
    for i in range(200):
        producer.publish(topics.decisions, b"d%d" % i, key="r")
    assert forwarder.forward_once(0) == 200
    kind, batch = read.recv()
    assert kind == RECORDS and [value for _, _, value, _, _ in batch] == [
        b"d%d" % i for i in range(200)
    ]
    assert not read.poll(0)  # one message for the whole burst
    assert forwarder.forward_once(0) == 0 and not read.poll(0)  # committed: nothing twice


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="niceness is a Unix notion")
def test_the_child_runs_at_the_niceness_asked_for():
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    runtime = open_runtime(settings(**{"worker.embedded_process_nice": 5}))
    try:
        assert os.getpriority(os.PRIO_PROCESS, runtime.child.process.pid) == min(19, mine + 5)
    finally:
        runtime.close()


def test_a_pipe_broken_on_send_still_names_the_exit_code():
    # The trainer's publisher can see the broken pipe before the receiver thread
    # sees the child's end: the report must name the exit code either way.
    runtime = open_runtime(settings())
    child = runtime.child
    try:
        child.process.kill()
        child.process.wait(timeout=10)
        assert _wait_for(lambda: child.problem)
        child.problem = None  # as if the send had lost the race to the receiver
        child._lost("the bridge closed: [Errno 32] Broken pipe")
        assert "exited with code -9" in child.problem
        assert "Broken pipe" in child.problem
    finally:
        runtime.close()


def _scrape(port: int) -> str:
    from urllib.request import urlopen

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_childs_metrics_are_served_with_the_trainers_on_one_port(tmp_path):
    from prometheus_client import CollectorRegistry

    from spikeguard.metrics import Metrics

    port = _free_port()
    local = Metrics(CollectorRegistry())
    local.trainer_unprotected.labels("served").set(1)  # a series of the trainer's own process
    runtime = open_runtime(settings(metrics_port=port), metrics=local)
    try:
        prefix = runtime.topics.prefix
        guard, model, optimizer, x, y = _guarded(runtime, tmp_path, "served")
        _train(guard, model, optimizer, x, y, 30)
        guard.publisher.flush(10.0)

        def served(
            text: str,
        ) -> bool:  # every step seen, and consumed by the detectors' worker (its own pace)
            consumed = [
                line
                for line in text.splitlines()
                if line.startswith("spikeguard_records_consumed_total{")
                and f'component="detectors",topic="{prefix}steps"' in line
            ]
            return (
                'spikeguard_run_last_step{run_id="served"} 29.0' in text
                and bool(consumed)
                and float(consumed[0].rsplit(" ", 1)[1]) >= 30
            )

        text = _wait_for(lambda: (lambda t: t if served(t) else None)(_scrape(port)))
        guard.close()
    finally:
        runtime.close()
    assert text, "the child's per-run series never reached the trainer's port"
    lines = text.splitlines()
    assert 'spikeguard_trainer_unprotected{run_id="served"} 1.0' in lines  # the trainer's own
    # Consumer lag of both buses: the workers' groups (child) and the bridge's (trainer).
    assert any(
        f'group="{prefix}detectors"' in line
        for line in lines
        if line.startswith("spikeguard_consumer_lag")
    )
    assert any(
        f'group="{prefix}bridge"' in line and f'topic="{prefix}steps"' in line
        for line in lines
        if line.startswith("spikeguard_consumer_lag")
    )
    consumed = [
        line
        for line in lines
        if line.startswith("spikeguard_records_consumed_total{")
        and f'component="detectors",topic="{prefix}steps"' in line
    ]
    assert consumed and float(consumed[0].rsplit(" ", 1)[1]) >= 30
    # One family per name, though both processes declare every family.
    types = [line for line in lines if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    assert not [line for line in lines if line.startswith("process_") and "child" in line]
    with pytest.raises(OSError):
        _scrape(port)  # closed with the runtime
    # After close, the child's final counts stay readable in the trainer's process.
    final = {m.name: m for m in runtime.child.metrics()}
    assert any(
        s.value >= 30
        for s in final["spikeguard_records_consumed"].samples
        if s.labels.get("component") == "detectors"
    )


def test_where_no_child_can_start_the_pipeline_runs_as_threads_and_says_so(
    tmp_path, monkeypatch, caplog
):
    import logging
    import sys

    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    data_dir = tmp_path / "bus"
    with caplog.at_level(logging.INFO, logger="spikeguard.runtime"):
        runtime = open_runtime(settings(data_dir=str(data_dir)))
    try:
        assert runtime.child is None
        assert {w.stage.name for w in runtime.workers} == {"detectors", "fusion", "actuator"}
        said = [r for r in caplog.records if r.name == "spikeguard.runtime"]
        assert [r.levelname for r in said] == ["INFO"] and "threads" in said[0].getMessage()
        assert "no-such-python" in said[0].getMessage()
        # Threads record into data_dir themselves, and judge the trainer's steps.
        assert runtime.bus.data_dir == data_dir
        model, optimizer, x, y = _tiny()
        config = GuardConfig(
            checkpoint_dir=str(tmp_path / "ckpt"),
            checkpoint_every=0,
            resume=False,
        )
        guard = Guard(
            model,
            optimizer,
            run_id="threads",
            config=config,
            runtime=runtime,
        )
        _train(guard, model, optimizer, x, y, 20)
        bus, topics = runtime.bus, runtime.topics
        assert _wait_for(
            lambda: (
                {
                    d.step
                    for d in (decode(r.value, Decision) for r in bus.read_all(topics.decisions))
                }
                >= set(range(20))
            )
        )
        guard.close()
    finally:
        runtime.close()
