"""Starting a guard never blocks training: a bad broker address, or a broker with no workers.

Why: a bad address could block ``Guard()`` for 37 s before failing, and a
lockstep demo with no workers could hang for 400 s without a word. The guard
starts at once with its local protections (the non-finite skip) and says in
one WARNING line what is missing.
"""

from __future__ import annotations

import logging
import math
import socket
import time
import uuid

import pytest
import torch

from spikeguard.components import COMPONENTS
from spikeguard.producers import Guard
from spikeguard.producers.config import GuardConfig

KEY = "startup-test-key-0123456789"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nobody listens once it is closed


def guard_env(monkeypatch, bootstrap: str, prefix: str = "spikeguard.") -> None:
    monkeypatch.setenv("SPIKEGUARD_BOOTSTRAP_SERVERS", bootstrap)
    monkeypatch.setenv("SPIKEGUARD_SIGNING_KEY", KEY)
    monkeypatch.setenv("SPIKEGUARD_TOPIC_PREFIX", prefix)
    monkeypatch.delenv("SPIKEGUARD_INSECURE", raising=False)


def train(guard: Guard, model, optimizer, steps: int, nan_at: int | None = None) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for step in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == nan_at:
            loss = loss * float("nan")
        loss.backward()
        guard.step(loss)


def ours(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("spikeguard")]


def joined(consumer):
    """Poll until the group gave this member its partitions (it is a live member then)."""
    deadline = time.monotonic() + 60
    while not consumer.assignment():
        assert time.monotonic() < deadline, "the consumer never joined its group"
        consumer.poll(timeout=0.2)
    return consumer


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


@pytest.mark.parametrize(
    "address",
    [f"127.0.0.1:{closed_port()}", "broker.invalid:9092"],
    ids=["closed-port", "unresolvable-name"],
)
@pytest.mark.heavy
def test_a_bad_broker_address_does_not_block_the_guard(address, monkeypatch, tmp_path, caplog):
    guard_env(monkeypatch, address)
    model, optimizer = tiny()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        guard = Guard(
            model,
            optimizer,
            run_id="offline-run",
            config=GuardConfig(checkpoint_dir=str(tmp_path), resume=False, lockstep=True),
        )
    took = time.monotonic() - started
    print(f"\nGuard() with an unreachable broker ({address}) returned in {took:.1f} s")
    assert took < 20, f"Guard() blocked {took:.0f}s on an unreachable broker"  # was 37 s
    said = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name.startswith("spikeguard")
    ]
    assert len([m for m in said if address in m]) == 1, said
    assert "local protections" in " ".join(said)
    try:
        train(
            guard, model, optimizer, 30, nan_at=12
        )  # lockstep: would wait on every step if connected
        assert guard.step_count == 30 and guard.counters["skipped_updates"] == 1
        assert all(math.isfinite(float(p.detach().abs().sum())) for p in model.parameters())
    finally:
        guard.close()


@pytest.mark.kafka
def test_no_workers_is_said_at_once_and_training_goes_on(
    kafka_bootstrap, monkeypatch, tmp_path, caplog
):
    guard_env(monkeypatch, kafka_bootstrap, f"lonely-{uuid.uuid4().hex[:8]}.")
    model, optimizer = tiny()
    with caplog.at_level(logging.WARNING):
        guard = Guard(
            model,
            optimizer,
            run_id="lonely-run",
            config=GuardConfig(checkpoint_dir=str(tmp_path), resume=False),
        )
    said = [r.getMessage() for r in caplog.records if "no pipeline workers" in r.getMessage()]
    assert len(said) == 1 and "statistical" in said[0] and "local protections" in said[0], said
    try:
        train(guard, model, optimizer, 20, nan_at=5)
        assert guard.step_count == 20 and guard.counters["skipped_updates"] == 1
    finally:
        guard.close()


@pytest.mark.kafka
def test_a_lockstep_guard_without_workers_stops_waiting_after_one_timeout(
    kafka_bootstrap, monkeypatch, tmp_path, caplog
):
    guard_env(monkeypatch, kafka_bootstrap, f"lonely-{uuid.uuid4().hex[:8]}.")
    model, optimizer = tiny()
    guard = Guard(
        model,
        optimizer,
        run_id="lonely-lockstep",
        config=GuardConfig(
            checkpoint_dir=str(tmp_path), resume=False, lockstep=True, lockstep_timeout=2.0
        ),
    )
    try:
        with caplog.at_level(logging.WARNING):
            train(guard, model, optimizer, 40)
        assert guard.step_count == 40
        assert guard.waiter.timeouts == 1  # one wait of lockstep_timeout, not one per step
        said = [r.getMessage() for r in caplog.records if "no decision" in r.getMessage()]
        assert len(said) == 1, said
    finally:
        guard.close()


@pytest.mark.kafka
def test_a_running_pipeline_is_not_reported_missing(kafka_bootstrap, monkeypatch, tmp_path, caplog):
    """Every component's consumer group has a live member: no warning; one missing: named."""
    from spikeguard.bus.kafka import KafkaBus
    from spikeguard.schemas import Topics

    prefix = f"busy-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    bus = KafkaBus(kafka_bootstrap)
    bus.create_topics(topics.all())
    members = {name: bus.consumer(f"{prefix}{name}", [topics.steps]) for name in COMPONENTS}
    try:
        for consumer in members.values():
            joined(consumer)
        guard_env(monkeypatch, kafka_bootstrap, prefix)
        model, optimizer = tiny()
        with caplog.at_level(logging.WARNING):
            Guard(
                model,
                optimizer,
                run_id="busy-run",
                config=GuardConfig(checkpoint_dir=str(tmp_path / "a"), resume=False),
            ).close()
        assert not [r for r in caplog.records if "pipeline" in r.getMessage()], caplog.text
        members.pop("actuator").close()
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            Guard(
                model,
                optimizer,
                run_id="busy-run-2",
                config=GuardConfig(checkpoint_dir=str(tmp_path / "b"), resume=False),
            ).close()
        said = [r.getMessage() for r in caplog.records if "pipeline" in r.getMessage()]
        assert len(said) == 1 and "actuator" in said[0] and "statistical" not in said[0], said
    finally:
        for consumer in members.values():
            consumer.close()
        bus.close()


@pytest.mark.kafka
def test_workers_that_stop_mid_run_are_said_and_so_is_their_return(kafka_bootstrap, caplog):
    """The watch re-checks the components' groups: a worker gone, and back, is one line each."""
    from spikeguard.bus.kafka import KafkaBus
    from spikeguard.pipeline_watch import PipelineWatch
    from spikeguard.schemas import Topics

    prefix = f"watch-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    bus = KafkaBus(kafka_bootstrap, session_timeout_ms=6000, heartbeat_interval_ms=1000)
    bus.create_topics(topics.all())
    members = {name: bus.consumer(f"{prefix}{name}", [topics.steps]) for name in COMPONENTS}
    watch = PipelineWatch(bus, topics, kafka_bootstrap, interval_s=0)  # checked by hand below
    try:
        for consumer in members.values():
            joined(consumer)
        with caplog.at_level(logging.WARNING, logger="spikeguard.pipeline_watch"):
            assert watch.check() == []
            assert not ours(caplog)  # a complete pipeline at start is not news
            members.pop("fusion").close()  # leaves its group
            assert watch.check() == ["fusion"]
            assert watch.check() == ["fusion"]  # no change, no second line
            members["fusion"] = joined(bus.consumer(f"{prefix}fusion", [topics.steps]))
            assert watch.check() == []
        said = ours(caplog)
        assert len(said) == 2, said
        assert "no worker runs for fusion" in said[0] and "runs again" in said[1]
    finally:
        for consumer in members.values():
            consumer.close()
        bus.close()


@pytest.mark.kafka
def test_cohosted_detectors_count_as_the_four_detectors(kafka_bootstrap, caplog):
    """`spikeguard worker detectors` runs the four detectors under one group: the watch sees them."""
    from spikeguard.bus.kafka import KafkaBus
    from spikeguard.pipeline_watch import PipelineWatch
    from spikeguard.schemas import Topics

    prefix = f"watch-{uuid.uuid4().hex[:8]}."
    topics = Topics(prefix)
    bus = KafkaBus(kafka_bootstrap, session_timeout_ms=6000, heartbeat_interval_ms=1000)
    bus.create_topics(topics.all())
    members = {
        name: bus.consumer(f"{prefix}{name}", [topics.steps]) for name in ("detectors", "fusion")
    }
    watch = PipelineWatch(bus, topics, kafka_bootstrap, interval_s=0)
    try:
        for consumer in members.values():
            joined(consumer)
        with caplog.at_level(logging.WARNING, logger="spikeguard.pipeline_watch"):
            assert watch.check() == ["actuator"]
            members.pop("detectors").close()  # leaves its group: the four are missing again
            assert watch.check() == ["statistical", "rules", "ml", "predictor", "actuator"]
    finally:
        for consumer in members.values():
            consumer.close()
        bus.close()
