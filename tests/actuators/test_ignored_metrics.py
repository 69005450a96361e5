"""What fusion and the policy ignore on purpose reaches Prometheus (real worker, embedded bus)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.components import build_stage
from spikeguard.metrics import Metrics
from spikeguard.schemas import Decision, Topics, Verdict, decision_id, encode
from spikeguard.settings import load_settings
from spikeguard.streaming.worker import Worker

TOPICS = Topics("ignored-test.")
ALL = ("statistical", "rules", "ml", "predictor")


def worker_for(component: str) -> tuple[EmbeddedBus, Worker, CollectorRegistry]:
    bus = EmbeddedBus(partitions=1)
    settings = load_settings({"topic_prefix": TOPICS.prefix}, env={})
    registry = CollectorRegistry()
    worker = Worker(
        bus, build_stage(component, settings, TOPICS), metrics=Metrics(registry), snapshots=False
    )
    return bus, worker, registry


def ignored(registry: CollectorRegistry, component: str, reason: str) -> float:
    value = registry.get_sample_value(
        "spikeguard_ignored_records_total", {"component": component, "reason": reason}
    )
    return value or 0.0


def run(bus: EmbeddedBus, worker: Worker, topic: str, events: list) -> None:
    producer = bus.producer()
    for event in events:
        producer.publish(topic, encode(event), key=event.run_id)
    while worker.run_once(timeout=0):
        pass


def verdict(step: int, detector: str, epoch: int = 0, run_id: str = "r") -> Verdict:
    return Verdict(run_id=run_id, step=step, epoch=epoch, detector=detector, is_anomaly=False)


def test_fusion_counts_late_stale_and_duplicate_verdicts() -> None:
    bus, worker, registry = worker_for("fusion")
    step0 = [verdict(0, d) for d in ALL]
    run(bus, worker, TOPICS.verdicts, step0 + [step0[0]])  # decided, then a late copy
    assert ignored(registry, "fusion", "late_verdict") == 1
    pending = [
        verdict(1, "rules"),
        verdict(1, "rules"),
        verdict(1, "rules", run_id="other"),
        verdict(1, "rules", run_id="other"),
    ]  # two runs in one batch, one duplicate each
    run(bus, worker, TOPICS.verdicts, pending)
    assert ignored(registry, "fusion", "duplicate_verdict") == 2
    run(bus, worker, TOPICS.verdicts, [verdict(0, "rules", epoch=1), verdict(5, "ml", epoch=0)])
    assert ignored(registry, "fusion", "stale_verdict") == 1  # epoch 0 after epoch 1 began
    # counted once: the next batches add nothing for what was already exported
    run(bus, worker, TOPICS.verdicts, [verdict(1, "ml", epoch=1)])
    assert (
        ignored(registry, "fusion", "late_verdict"),
        ignored(registry, "fusion", "duplicate_verdict"),
        ignored(registry, "fusion", "stale_verdict"),
    ) == (1, 2, 1)


def test_the_policy_counts_duplicate_and_late_decisions() -> None:
    bus, worker, registry = worker_for("actuator")

    def decision(step: int) -> Decision:
        return Decision(decision_id=decision_id("r", step), run_id="r", step=step, is_anomaly=False)

    run(
        bus, worker, TOPICS.decisions, [decision(s) for s in range(10)] + [decision(9), decision(3)]
    )
    policy = worker.stage.runs["r"]
    assert policy.counts["duplicate"] == 2  # 9 again; 3 is also a decision id it has seen
    assert ignored(registry, "actuator", "duplicate_decision") == 2
    assert ignored(registry, "actuator", "late_decision") == 0
    unseen = Decision(decision_id="d-from-elsewhere", run_id="r", step=4, is_anomaly=False)
    run(bus, worker, TOPICS.decisions, [unseen])  # behind the newest step, never seen: late
    assert ignored(registry, "actuator", "late_decision") == 1
    assert ignored(registry, "actuator", "duplicate_decision") == 2
