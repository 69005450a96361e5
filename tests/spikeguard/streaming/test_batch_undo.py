"""A failed batch is undone for the runs it touched, and only those, from a cheap undo point.

The worker takes :meth:`Stage.undo_point` of a batch's runs before every batch
(fusion: its pending verdicts kept as the frozen events they are, not dumped to
JSON). A batch that fails is rewound to it and retried record by record, the
failing record alone going to the DLQ: the outcome must be exactly that of a
pipeline that never saw the failing record.
"""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

from spikeguard.bus import EmbeddedBus
from spikeguard.metrics import Metrics
from spikeguard.processors.fusion import Fusion
from spikeguard.processors.fusion_stage import FusionStage
from spikeguard.schemas import DeadLetter, Decision, Topics, Verdict, decode, encode
from spikeguard.streaming.worker import Worker

TOPICS = Topics("undo-test.")
DETECTORS = ("statistical", "rules", "ml", "predictor")


class Faulty(Fusion):
    """A real fusion that fails on a poisoned verdict after having taken it in (a half-done batch)."""

    def _add(self, verdict, now, out):  # type: ignore[no-untyped-def]
        super()._add(verdict, now, out)
        if verdict.signals.get("poison"):
            raise RuntimeError(f"fault at run {verdict.run_id} step {verdict.step}")


def verdict(run_id: str, step: int, detector: str, *, poison: bool = False) -> Verdict:
    loss = 2.0 + 0.1 * ((step * 7 + len(run_id)) % 5)
    return Verdict(
        run_id=run_id,
        step=step,
        detector=detector,
        is_anomaly=detector == "rules" and step == 4,
        confidence=0.9 if detector == "rules" and step == 4 else 0.0,
        loss=loss,
        grad_norm=1.0 + step / 10,
        signals={"poison": 1} if poison else {},
    )


def first_batch() -> list[Verdict]:
    """Runs a, b, c: steps 0-2 decided, step 3 pending (two detectors of four)."""
    out = [verdict(run, s, d) for run in "abc" for s in range(3) for d in DETECTORS]
    return out + [verdict(run, 3, d) for run in "abc" for d in DETECTORS[:2]]


def second_batch(with_poison: bool) -> list[Verdict]:
    """Runs a and b only: step 3 completed, step 4 partly; b's step 4 carries the poisoned verdict."""
    out = [verdict(run, 3, d) for run in "ab" for d in DETECTORS[2:]]
    out += [verdict("a", 4, d) for d in DETECTORS[:3]] + [verdict("b", 4, "rules")]
    if with_poison:
        out.append(verdict("b", 4, "ml", poison=True))
    return out + [verdict("b", 4, "statistical")]


def pipeline(fusion: type[Fusion]) -> tuple[EmbeddedBus, FusionStage, Worker]:
    bus = EmbeddedBus(partitions=1)
    stage = FusionStage(TOPICS, lambda run_id, config=None: fusion(config, run_id=run_id))
    return bus, stage, Worker(bus, stage, metrics=Metrics(CollectorRegistry()), snapshots=False)


def feed(bus: EmbeddedBus, worker: Worker, verdicts: list[Verdict]) -> None:
    producer = bus.producer()
    for v in verdicts:
        producer.publish(TOPICS.verdicts, encode(v), key=v.run_id)
    assert worker.run_once(timeout=0) == len(verdicts)  # one batch, one transaction


def comparable(state: dict) -> str:
    """A fusion's state without its wall-clock times (the two pipelines run at different times)."""
    state = dict(state, marks={name: mark[0] for name, mark in state["marks"].items()})
    state.pop("epoch_seen_at")
    return json.dumps(state, sort_keys=True)


def decisions(bus: EmbeddedBus) -> list[str]:
    return [
        json.dumps(decode(r.value, Decision).model_dump(mode="json"), sort_keys=True)
        for r in bus.read_all(TOPICS.decisions)
    ]


def test_a_failed_batch_is_undone_for_its_runs_only_and_only_the_failing_record_goes_to_the_dlq():
    bus, stage, worker = pipeline(Faulty)
    feed(bus, worker, first_batch())
    untouched = stage.runs["c"]
    untouched_state = json.dumps(untouched.state_dict(), sort_keys=True)
    restored: list[set[str]] = []
    restore = stage.restore
    stage.restore = lambda state: (restored.append(set(state)), restore(state))[1]  # type: ignore[method-assign]

    feed(bus, worker, second_batch(with_poison=True))

    clean_bus, clean, clean_worker = pipeline(Fusion)
    feed(clean_bus, clean_worker, first_batch())
    feed(clean_bus, clean_worker, second_batch(with_poison=False))
    # The batch was rewound for its own runs (a and b), then each failing record for its run alone.
    assert restored == [{"a", "b"}, {"b"}]
    for run_id in "ab":
        assert comparable(stage.runs[run_id].state_dict()) == comparable(
            clean.runs[run_id].state_dict()
        )
    assert decisions(bus) == decisions(clean_bus)
    assert len(decisions(bus)) == 3 * 3 + 2  # steps 0-2 of a, b, c, then step 3 of a and b
    # The run the batch did not touch: the same object, the same state.
    assert stage.runs["c"] is untouched
    assert json.dumps(stage.runs["c"].state_dict(), sort_keys=True) == untouched_state
    letters = [decode(r.value, DeadLetter) for r in bus.read_all(TOPICS.dlq)]
    assert [(d.error, d.offset) for d in letters] == [("RuntimeError", len(first_batch()) + 8)]
    assert "fault at run b step 4" in letters[0].reason


def test_fusion_undo_state_keeps_the_verdicts_and_puts_the_state_back_exactly():
    fusion = Fusion(run_id="a")
    for v in first_batch()[:12] + [verdict("a", 3, "rules"), verdict("a", 4, "ml")]:
        fusion.add(v, now=100.0)
    fusion.add(
        Verdict(run_id="a", step=5, detector="ml", is_anomaly=False, loss=float("nan")), now=100.0
    )
    before = json.dumps(fusion.state_dict(), sort_keys=True)
    point = fusion.undo_state()
    kept = [v for item in point["pending"] for v in item["verdicts"]]
    assert kept and all(
        type(v) is Verdict for v in kept
    )  # the events themselves: no dump per batch
    for step in (3, 4, 5, 6):  # decide steps, learn baselines, open a new pending step
        for d in DETECTORS:
            fusion.add(verdict("a", step, d), now=101.0)
    assert json.dumps(fusion.state_dict(), sort_keys=True) != before
    fusion.load_state_dict(point)
    assert json.dumps(fusion.state_dict(), sort_keys=True) == before
    # And the JSON form still round-trips the same way (what a saved snapshot holds).
    again = Fusion(run_id="a")
    again.load_state_dict(json.loads(before))
    assert json.dumps(again.state_dict(), sort_keys=True) == before


def test_the_policy_undo_state_copies_its_seen_window_and_puts_the_state_back_exactly():
    from spikeguard.actuators.policy import RecoveryPolicy

    def decision(step: int) -> Decision:
        return Decision(decision_id=f"d-{step}", run_id="a", step=step, is_anomaly=False)

    policy = RecoveryPolicy(run_id="a")
    for step in range(50):
        policy.on_decision(decision(step))
    before = json.dumps(policy.state_dict(), sort_keys=True)
    point = policy.undo_state()
    assert (
        type(point["seen"]) is not list
    )  # a copy of the window's arrays, not 50 [key, step] lists
    for step in range(50, 80):
        policy.on_decision(decision(step))
    policy.on_decision(decision(10))  # a duplicate, counted
    assert json.dumps(policy.state_dict(), sort_keys=True) != before
    policy.load_state_dict(point)
    assert json.dumps(policy.state_dict(), sort_keys=True) == before
    policy.on_decision(decision(50))  # the restored window is its own: the point stays as taken
    policy.load_state_dict(point)
    assert json.dumps(policy.state_dict(), sort_keys=True) == before
