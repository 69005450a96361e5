"""Per-run state: saved per run and only when changed, evicted when a run ends or idles,
never larger than a broker accepts, and restored without learning a record twice."""

import json

import pytest
from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.bus.embedded import EmbeddedProducer
from spikeguard.errors import DeliveryError
from spikeguard.metrics import Metrics
from spikeguard.processors.detector_stage import DetectorStage
from spikeguard.schemas import RunEvent, StepEvent, encode
from spikeguard.streaming.state_store import StateStore
from spikeguard.streaming.worker import Worker

from spikeguard.processors.detectors.base import Detector
from spikeguard.schemas import Topics, Verdict, decode

TOPICS = Topics("t.")


class Sum:
    def __init__(self) -> None:
        self.total = 0.0
        self.seen = 0


class RunningSum(Detector[Sum]):
    """A detector whose every verdict depends on all the state before it (as in test_worker)."""

    name = "sum"

    def fresh(self) -> Sum:
        return Sum()

    def score(self, event: StepEvent, state: Sum) -> Verdict:
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

    def state_dict(self):
        return self.dump(self.state)

    def load_state_dict(self, state):
        self.state = self.load(state)


def make_worker(bus, registry=None, **kwargs):
    stage = DetectorStage(TOPICS, "sum", lambda run_id: RunningSum())
    return Worker(bus, stage, metrics=Metrics(registry or CollectorRegistry()), **kwargs)


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


def state_records(bus):
    """The state topic's live records: key -> value (None for a tombstone), newest per key."""
    found = {}
    for record in bus.read_all(TOPICS.state("sum")):
        found[record.key.decode()] = None if record.value is None else json.loads(record.value)
    return found


def end_run(bus, run_id, last_step, epoch=0):
    bus.create_topics([TOPICS.runs], compacted=True)
    event = RunEvent(run_id=run_id, kind="end", step=last_step + 1, epoch=epoch, finished=True)
    bus.producer().publish(TOPICS.runs, encode(event), key=run_id)


def test_state_is_saved_per_run_and_only_for_the_runs_that_changed():
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus, snapshot_interval_s=3600)
    publish_steps(bus, range(5), runs=("a", "b", "c"))
    drain(worker)
    worker.checkpoint()
    first = bus.end_offset(TOPICS.state("sum"), 0)
    assert set(state_records(bus)) == {"sum/run/a", "sum/run/b", "sum/run/c", "sum/partition/0"}
    assert state_records(bus)["sum/run/b"] == {
        "partition": 0,
        "offsets": {TOPICS.steps: 15},
        "state": {"total": 12.5, "seen": 5},
    }

    publish_steps(bus, range(5, 8), runs=("b",))
    drain(worker)
    worker.checkpoint()
    written = [r.key.decode() for r in bus.read_all(TOPICS.state("sum")) if r.offset >= first]
    assert written == ["sum/run/b", "sum/partition/0"]  # a and c did not change
    assert StateStore(bus, TOPICS.state("sum")).load(0) == {
        "offsets": {TOPICS.steps: 18},
        "runs": {
            "a": {"total": 12.5, "seen": 5},
            "b": {"total": 12.5 + 5.5 + 6.5 + 0.5, "seen": 8},
            "c": {"total": 12.5, "seen": 5},
        },
    }


@pytest.mark.heavy
def test_no_state_record_grows_with_the_number_of_runs():
    bus = EmbeddedBus(partitions=2)
    worker = make_worker(bus, snapshot_interval_s=3600, max_records=5000)
    publish_steps(bus, range(2), runs=[f"run-{i}" for i in range(3000)])
    drain(worker)
    worker.checkpoint()
    records = bus.read_all(TOPICS.state("sum"))
    assert len(records) == 3000 + 2  # one per run, one per partition
    assert max(len(r.value) for r in records) < 200


class DiesAtPartitionRecord(EmbeddedProducer):
    """Killed after the run records of a checkpoint went out, before the partition's record."""

    def publish(self, topic, value, key=None, headers=None):
        if isinstance(key, str) and "/partition/" in key:
            raise DeliveryError("killed before the partition record")
        super().publish(topic, value, key, headers)


def test_a_worker_killed_between_run_records_and_partition_record_learns_nothing_twice():
    reference = EmbeddedBus(partitions=1)
    publish_steps(reference, range(40), runs=("a", "b"))
    drain(make_worker(reference, max_records=20))
    expected = verdicts(reference)

    bus = EmbeddedBus(partitions=1)
    publish_steps(bus, range(40), runs=("a", "b"))
    first = make_worker(bus, max_records=20, snapshot_interval_s=3600)
    first.run_once(timeout=0)
    first.checkpoint()  # a whole checkpoint at offset 20
    first.run_once(timeout=0)  # offsets 20-39 judged, then the next checkpoint dies halfway
    first._producer = DiesAtPartitionRecord(bus)
    with pytest.raises(DeliveryError):
        first.checkpoint()
    first._consumer.close()  # killed: no commit
    saved = state_records(bus)
    assert saved["sum/run/a"]["offsets"] == {TOPICS.steps: 40}  # the runs are ahead...
    assert saved["sum/partition/0"]["offsets"] == {TOPICS.steps: 20}  # ...of their partition

    second = make_worker(bus, max_records=20)
    drain(second)
    got = verdicts(bus)
    assert set(got) == set(expected)
    for key, signals in got.items():
        assert signals == expected[key], key
    # Nothing learnt twice: the restored runs skipped the records already in their state.
    assert second.stage.runs["a"].state_dict() == {
        "total": sum(s % 7 + 0.5 for s in range(40)),
        "seen": 40,
    }


def test_a_run_that_ends_is_dropped_tombstoned_and_its_series_removed():
    bus = EmbeddedBus(partitions=1)
    registry = CollectorRegistry()
    worker = make_worker(bus, registry, snapshot_interval_s=3600, metrics_linger_s=0)
    publish_steps(bus, range(10), runs=("a", "b"))
    drain(worker)
    worker.checkpoint()
    assert registry.get_sample_value("spikeguard_run_last_step", {"run_id": "a"}) == 9
    assert "sum/run/a" in state_records(bus)

    end_run(bus, "a", last_step=9)
    drain(worker)
    assert "a" not in worker.stage.runs and "b" in worker.stage.runs
    assert registry.get_sample_value("spikeguard_run_last_step", {"run_id": "a"}) is None
    assert registry.get_sample_value("spikeguard_run_last_step", {"run_id": "b"}) == 9
    assert (
        registry.get_sample_value(
            "spikeguard_runs_evicted_total", {"component": "sum", "reason": "ended"}
        )
        == 1
    )
    worker.checkpoint()
    saved = state_records(bus)
    assert saved["sum/run/a"] is None  # a tombstone: compaction forgets the run
    assert saved["sum/run/b"]["state"]["seen"] == 10
    assert StateStore(bus, TOPICS.state("sum")).load(0)["runs"].keys() == {"b"}
    # A restarted worker does not bring the ended run back.
    worker._consumer.close()
    again = make_worker(bus)
    drain(again)
    assert set(again.stage.runs) == {"b"}


def test_the_end_of_a_run_never_saved_writes_nothing():
    # A new group reads every past run's end on the compacted runs topic: no tombstone flood.
    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus, snapshot_interval_s=0)
    publish_steps(bus, range(2), runs=("a",))
    for old in ("old-1", "old-2", "old-3"):
        end_run(bus, old, last_step=100)
    drain(worker)
    worker.checkpoint()
    assert set(state_records(bus)) == {"sum/run/a", "sum/partition/0"}


def test_an_end_read_before_the_runs_last_steps_waits_for_them():
    reference = EmbeddedBus(partitions=1)
    publish_steps(reference, range(10), runs=("a",))
    drain(make_worker(reference, snapshots=False))
    expected = verdicts(reference)

    bus = EmbeddedBus(partitions=1)
    worker = make_worker(bus, snapshots=False)
    publish_steps(bus, range(5), runs=("a",))
    drain(worker)
    end_run(bus, "a", last_step=9)  # read before steps 5-9
    drain(worker)
    assert "a" in worker.stage.runs  # not yet: steps 5-9 must be judged with its state
    publish_steps(bus, range(5, 10), runs=("a",))
    drain(worker)
    assert verdicts(bus) == expected
    assert "a" not in worker.stage.runs


def test_forget_is_not_an_end():
    stage = DetectorStage(TOPICS, "sum", lambda run_id: RunningSum())
    stage.run("a"), stage.run("b")
    stage.forget(["a"])  # the partition moved: its new owner keeps the state
    assert stage.drain_ended() == []
    stage.end_runs(["b"])
    assert stage.runs == {} and stage.drain_ended() == ["b"]


def test_runs_idle_past_the_ttl_are_evicted_and_tombstoned():
    bus = EmbeddedBus(partitions=1)
    registry = CollectorRegistry()
    clock = [1000.0]
    worker = make_worker(
        bus,
        registry,
        snapshot_interval_s=0,
        run_idle_ttl_s=600,
        clock=lambda: clock[0],
        metrics_linger_s=30,
    )
    publish_steps(bus, range(3), runs=("a", "b"))
    drain(worker)
    clock[0] = 1500.0
    publish_steps(bus, range(3, 6), runs=("b",))
    drain(worker)
    assert set(worker.stage.runs) == {"a", "b"}
    clock[0] = 1700.0  # a silent for 700 s, b for 200 s
    worker.run_once(timeout=0)
    assert set(worker.stage.runs) == {"b"}
    assert (
        registry.get_sample_value(
            "spikeguard_runs_evicted_total", {"component": "sum", "reason": "idle"}
        )
        == 1
    )
    assert registry.get_sample_value("spikeguard_runs_in_memory", {"component": "sum"}) == 1
    # Its series outlive it by the linger time, so the next scrape still sees its last values.
    assert registry.get_sample_value("spikeguard_run_last_step", {"run_id": "a"}) == 2
    clock[0] = 1731.0
    worker.run_once(timeout=0)
    assert registry.get_sample_value("spikeguard_run_last_step", {"run_id": "a"}) is None
    assert registry.get_sample_value("spikeguard_run_last_step", {"run_id": "b"}) == 5
    saved = state_records(bus)
    assert saved["sum/run/a"] is None and saved["sum/run/b"]["state"]["seen"] == 6


class Hoarder(RunningSum):
    """A detector whose state of one run grows without bound."""

    def dump(self, state: Sum) -> dict:
        return {**super().dump(state), "pad": "x" * (5000 if state.seen > 3 else 0)}

    def load(self, data: dict) -> Sum:
        return super().load(data)


def test_a_run_state_over_the_record_limit_is_refused_with_a_reason_not_a_crash(caplog):
    bus = EmbeddedBus(partitions=1)
    registry = CollectorRegistry()
    stage = DetectorStage(
        TOPICS, "sum", lambda run_id: Hoarder() if run_id == "big" else RunningSum()
    )
    worker = Worker(
        bus, stage, metrics=Metrics(registry), snapshot_interval_s=3600, max_state_record_bytes=2048
    )
    publish_steps(bus, range(2), runs=("big", "small"))
    drain(worker)
    worker.checkpoint()
    assert state_records(bus)["sum/run/big"]["state"]["seen"] == 2  # small enough so far
    publish_steps(bus, range(2, 6), runs=("big", "small"))
    drain(worker)
    with caplog.at_level("WARNING"):
        worker.checkpoint()
    assert any(
        "state of run big not saved" in r.getMessage() and "2048-byte" in r.getMessage()
        for r in caplog.records
    )
    assert (
        registry.get_sample_value("spikeguard_state_records_refused_total", {"component": "sum"})
        == 1
    )
    saved = state_records(bus)
    assert saved["sum/run/big"] is None  # its stale record is gone: a restart starts it afresh
    assert saved["sum/run/small"]["state"]["seen"] == 6
    assert max(len(r.value or b"") for r in bus.read_all(TOPICS.state("sum"))) <= 2048
    publish_steps(bus, range(6, 8), runs=("big", "small"))
    drain(worker)  # still alive, still judging
    assert sorted(s for (run, s) in verdicts(bus) if run == "big") == list(range(8))


def test_tombstones_survive_a_recorded_bus(tmp_path):
    bus = EmbeddedBus(partitions=1, data_dir=tmp_path)
    worker = make_worker(bus, snapshot_interval_s=3600)
    publish_steps(bus, range(4), runs=("a", "b"))
    drain(worker)
    worker.checkpoint()
    end_run(bus, "a", last_step=3)
    drain(worker)
    worker.close()
    bus.close()
    reopened = EmbeddedBus(partitions=1, data_dir=tmp_path)
    assert StateStore(reopened, TOPICS.state("sum")).load(0)["runs"].keys() == {"b"}


def test_the_older_one_record_per_partition_layout_is_still_restored():
    bus = EmbeddedBus(partitions=1)
    publish_steps(bus, range(6), runs=("a",))
    bus.create_topics([TOPICS.state("sum")], compacted=True)
    legacy = {"offsets": {TOPICS.steps: 3}, "runs": {"a": {"total": 0.5 + 1.5 + 2.5, "seen": 3}}}
    bus.producer().publish(TOPICS.state("sum"), json.dumps(legacy).encode(), key="0")
    worker = make_worker(bus, snapshot_interval_s=3600)
    drain(worker)
    assert worker.stage.runs["a"].state_dict() == {
        "total": sum(s + 0.5 for s in range(6)),
        "seen": 6,
    }
    worker.checkpoint()
    saved = state_records(bus)
    assert saved["0"] is None  # superseded: tombstoned
    assert saved["sum/partition/0"]["offsets"] == {TOPICS.steps: 6}


def test_a_state_with_non_finite_and_large_numbers_reads_back_as_json_dumps_wrote_it():
    """State records are encoded with pydantic's JSON (faster than json.dumps): what a
    restarted worker reads back must be exactly what json.dumps would have given it."""
    import math

    bus = EmbeddedBus(partitions=1)
    store = StateStore(bus, TOPICS.state("sum"))
    store.ensure_topic()
    state = {
        "nan": math.nan,
        "inf": math.inf,
        "-inf": -math.inf,
        "tiny": 5e-324,
        "third": 1 / 3,
        "big": 2**80,
        "rows": [[0.1, -2.5e300], (1, 2)],
        "text": 'é\n"',
        "none": None,
        "flag": True,
    }
    store.save(bus.producer(), 0, {TOPICS.steps: 7}, {"a": state})
    loaded = StateStore(bus, TOPICS.state("sum")).load(0)
    expected = json.loads(json.dumps(state))
    got = loaded["runs"]["a"]
    assert math.isnan(got.pop("nan")) and math.isnan(expected.pop("nan"))
    assert got == expected and type(got["big"]) is int and loaded["offsets"] == {TOPICS.steps: 7}
