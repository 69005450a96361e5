"""The worker loop: bad records to the DLQ, offsets after outputs, crash-safe state."""

import json

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.metrics import Metrics
from spikeguard.processors.detectors.base import Detector
from spikeguard.processors.detector_stage import DetectorStage
from spikeguard.streaming.state_store import StateStore
from spikeguard.streaming.worker import Worker
from spikeguard.schemas import DeadLetter, StepEvent, Topics, Verdict, decode, encode


class Sum:
    def __init__(self) -> None:
        self.total = 0.0
        self.seen = 0


class RunningSum(Detector[Sum]):
    """A detector whose every verdict depends on all the state before it."""

    name = "sum"

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        super().__init__()

    def fresh(self) -> Sum:
        return Sum()

    def score(self, event: StepEvent, state: Sum) -> Verdict:
        if event.step == self.fail_at:
            raise RuntimeError(f"cannot judge step {event.step}")
        return Verdict(
            run_id=event.run_id,
            step=event.step,
            detector=self.name,
            is_anomaly=False,
            signals={"total": state.total + event.loss, "seen": state.seen + 1},
        )

    def learn(self, event: StepEvent, state: Sum) -> None:
        state.total += event.loss
        state.seen += 1

    def dump(self, state: Sum) -> dict:
        return {"total": state.total, "seen": state.seen}

    def load(self, data: dict) -> Sum:
        state = Sum()
        state.total, state.seen = data["total"], data["seen"]
        return state

    # The plain state, as the snapshot assertions below spell it out.
    def state_dict(self):
        return self.dump(self.state)

    def load_state_dict(self, state):
        self.state = self.load(state)


TOPICS = Topics("t.")


def make_worker(bus, registry=None, fail_at=None, **kwargs):
    stage = DetectorStage(TOPICS, "sum", lambda run_id: RunningSum(fail_at))
    metrics = Metrics(registry or CollectorRegistry())
    return Worker(bus, stage, metrics=metrics, **kwargs)


def publish_steps(bus, steps, runs=("a", "b", "c")):
    producer = bus.producer()
    for step in steps:
        for run in runs:
            event = StepEvent(run_id=run, step=step, loss=float(step % 7) + 0.5, time=0.0)
            producer.publish(TOPICS.steps, encode(event), key=run)


def verdicts(bus):
    found = {}
    for record in bus.read_all(TOPICS.verdicts):
        v = decode(record.value, Verdict)
        found.setdefault((v.run_id, v.step), set()).add(json.dumps(v.signals, sort_keys=True))
    return found


def drain(worker):
    while worker.run_once(timeout=0):
        pass


def test_bad_records_go_to_the_dlq_with_a_reason_and_the_worker_goes_on():
    bus = EmbeddedBus(partitions=2)
    registry = CollectorRegistry()
    worker = make_worker(bus, registry, snapshots=False)
    producer = bus.producer()
    publish_steps(bus, range(3), runs=("a",))
    producer.publish(TOPICS.steps, b"{broken", key="a")
    producer.publish(TOPICS.steps, b'{"run_id": "a", "step": -4, "loss": 1}', key="a")
    producer.publish(
        TOPICS.steps, b'{"schema_version": 7, "run_id": "a", "step": 9, "loss": 1}', key="a"
    )
    publish_steps(bus, range(3, 6), runs=("a",))
    drain(worker)

    letters = [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]
    assert [letter.error for letter in letters] == [
        "MalformedMessage",
        "MalformedMessage",
        "UnknownSchemaVersion",
    ]
    assert "not JSON" in letters[0].reason and letters[0].value == "{broken"
    assert "step" in letters[1].reason
    assert all(
        letter.source_topic == TOPICS.steps and letter.offset is not None for letter in letters
    )
    assert sorted(step for _, step in verdicts(bus)) == [0, 1, 2, 3, 4, 5]
    assert (
        registry.get_sample_value(
            "spikeguard_dead_letters_total", {"component": "sum", "error": "MalformedMessage"}
        )
        == 2
    )


def test_a_record_the_stage_cannot_process_goes_to_the_dlq_alone():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus, fail_at=2, snapshots=False)
    publish_steps(bus, range(5), runs=("a",))
    drain(worker)
    letters = [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]
    assert len(letters) == 1
    assert letters[0].error == "RuntimeError" and "cannot judge step 2" in letters[0].reason
    assert sorted(step for _, step in verdicts(bus)) == [0, 1, 3, 4]


def test_offsets_are_committed_only_with_a_snapshot():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus, snapshot_interval_s=3600)
    publish_steps(bus, range(10), runs=("a",))
    drain(worker)
    group = bus._groups[worker.group]
    assert group.committed.get((TOPICS.steps, 0)) is None  # no snapshot yet: nothing committed
    worker.checkpoint()
    assert group.committed[(TOPICS.steps, 0)] == 10
    # Read back through the store: one record per run plus the partition's positions.
    snapshot = StateStore(bus, TOPICS.state("sum")).load(0)
    assert snapshot == {"offsets": {TOPICS.steps: 10}, "runs": {"a": {"total": 29.0, "seen": 10}}}


@pytest.mark.parametrize("crash_after_batches", [1, 3, 5])
def test_a_crashed_worker_resumes_with_the_same_verdicts_as_an_uninterrupted_one(
    crash_after_batches,
):
    reference_bus = EmbeddedBus(partitions=3)
    publish_steps(reference_bus, range(60))
    drain(make_worker(reference_bus, max_records=25))
    expected = verdicts(reference_bus)

    bus = EmbeddedBus(partitions=3)
    publish_steps(bus, range(60))
    first = make_worker(bus, max_records=25, snapshot_interval_s=0)
    for _ in range(crash_after_batches):
        first.run_once(timeout=0)
    # Records processed after the last snapshot and never committed: they will be redone.
    first.snapshot_interval_s = 3600
    first.run_once(timeout=0)
    first._consumer.close()  # killed: no final snapshot, no commit

    second = make_worker(bus, max_records=25)
    drain(second)
    got = verdicts(bus)
    assert set(got) == set(expected)
    for key, signals in got.items():
        # At-least-once: a redone step may appear twice, but always with the same content.
        assert signals == expected[key], key


class HalfDone(RunningSum):
    """Learns the step, then fails on it: a record that leaves its mark before it fails."""

    def score(self, event: StepEvent, state: Sum) -> Verdict:
        if event.step == self.fail_at:
            self.learn(event, state)
            raise RuntimeError(f"cannot judge step {event.step}")
        return super().score(event, state)


@pytest.mark.parametrize("detector", [RunningSum, HalfDone])
def test_a_retried_batch_does_not_count_twice(detector):
    # Five events, a bad one at step 2: the batch fails after steps 0 and 1 were
    # learnt, and the record-by-record retry must start from the state before it.
    bus = EmbeddedBus(partitions=1)
    stage = DetectorStage(TOPICS, "sum", lambda run_id: detector(2))
    worker = Worker(bus, stage, metrics=Metrics(CollectorRegistry()), snapshots=False)
    publish_steps(bus, range(5), runs=("a",))
    drain(worker)
    assert stage.runs["a"].state_dict() == {"total": 0.5 + 1.5 + 3.5 + 4.5, "seen": 4}
    seen = {step: json.loads(next(iter(s)))["seen"] for (_, step), s in verdicts(bus).items()}
    assert seen == {0: 1, 1: 2, 3: 3, 4: 4}
    assert len(bus.read_all(TOPICS.dlq)) == 1


def test_an_unreadable_snapshot_is_logged_and_counted(caplog):
    bus = EmbeddedBus(partitions=1)
    registry = CollectorRegistry()
    bus.create_topics([TOPICS.state("sum")], compacted=True)
    bus.producer().publish(TOPICS.state("sum"), b"{torn snapsh", key="0")
    publish_steps(bus, range(5), runs=("a",))
    with caplog.at_level("WARNING"):
        worker = make_worker(bus, registry)
        drain(worker)
    assert any(
        "unreadable" in r.getMessage() and "partition 0" in r.getMessage() for r in caplog.records
    )
    assert (
        registry.get_sample_value(
            "spikeguard_state_snapshots_unreadable_total", {"component": "sum"}
        )
        == 1
    )
    assert sorted(step for _, step in verdicts(bus)) == [0, 1, 2, 3, 4]  # started afresh


def test_a_snapshot_of_another_state_version_is_not_adopted(caplog):
    from spikeguard.components import build_stage
    from spikeguard.settings import load_settings

    bus = EmbeddedBus(partitions=1)
    registry = CollectorRegistry()
    stage = build_stage("rules", load_settings(), TOPICS)
    state = stage.run("a").state_dict()
    bus.create_topics([TOPICS.state("rules")], compacted=True)
    old = {"offsets": {TOPICS.steps: 3}, "runs": {"a": {**state, "version": 0}}}
    bus.producer().publish(TOPICS.state("rules"), json.dumps(old).encode(), key="0")
    publish_steps(bus, range(5), runs=("a",))
    fresh = build_stage("rules", load_settings(), TOPICS)
    with caplog.at_level("WARNING"):
        drain(Worker(bus, fresh, metrics=Metrics(registry)))
    assert any(
        "cannot restore partition 0" in r.getMessage() and "version 0" in r.getMessage()
        for r in caplog.records
    )
    assert (
        registry.get_sample_value(
            "spikeguard_state_snapshots_unreadable_total", {"component": "rules"}
        )
        == 1
    )
    # Not sought to the snapshot's offsets: every step judged, from a fresh state.
    assert sorted(step for _, step in verdicts(bus)) == [0, 1, 2, 3, 4]


def test_a_real_detector_retried_after_a_failure_learns_each_good_step_once():
    from spikeguard.processors.detectors import StatisticalDetector

    class Faulty(StatisticalDetector):
        """The real detector, with a fault injected after it has learnt step 2."""

        def learn(self, event, state):
            super().learn(event, state)
            if event.step == 2:
                raise RuntimeError("fault after learning step 2")

    bus = EmbeddedBus(partitions=1)
    stage = DetectorStage(TOPICS, "statistical", lambda run_id: Faulty())
    worker = Worker(bus, stage, metrics=Metrics(CollectorRegistry()), snapshots=False)
    publish_steps(bus, range(5), runs=("a",))
    drain(worker)
    clean = StatisticalDetector()
    clean.update_many(
        [StepEvent(run_id="a", step=s, loss=float(s % 7) + 0.5, time=0.0) for s in (0, 1, 3, 4)]
    )
    # Compared as JSON text: NaN fields are equal there, not only when they are the same float object.
    assert json.dumps(stage.runs["a"].state_dict(), sort_keys=True) == json.dumps(
        clean.state_dict(), sort_keys=True
    )
    assert stage.runs["a"].state_dict()["loss"]["n"] == 4  # four good steps, each learnt once


def test_the_state_store_gives_each_partition_its_own_snapshot():
    bus = EmbeddedBus(partitions=3)
    store = StateStore(bus, TOPICS.state("sum"))
    store.ensure_topic()
    producer = bus.producer()
    for partition in (2, 0, 1):
        store.save(producer, partition, {TOPICS.steps: 10 * partition}, {f"run-{partition}": {}})
    reader = StateStore(bus, TOPICS.state("sum"))
    for partition in (0, 1, 2):
        assert reader.load(partition) == {
            "offsets": {TOPICS.steps: 10 * partition},
            "runs": {f"run-{partition}": {}},
        }
