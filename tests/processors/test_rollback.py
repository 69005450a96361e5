"""After a rollback, re-run steps are judged as they were the first time (all four detectors).

The trainer rolls back to a checkpoint and re-runs from its step under a new
epoch. The detectors must judge the re-run from the state they had at that
step, not from the end of the first pass: on a falling loss curve the re-run's
loss is higher than where the first pass ended, and judged against that it
looked like a spike (84 consecutive loss_spike verdicts after a 200-step
rollback, before the state was put back).
"""

from __future__ import annotations

import json
import math
import random

import pytest

from spikeguard.processors.detectors import CONFIGS, DETECTORS
from spikeguard.processors.detectors.history import StateHistory
from spikeguard.schemas import StepEvent, Topics, Verdict, decode, encode

FIRST_PASS = 1500


def falling(start: int, stop: int, seed: int, epoch: int = 0) -> list[StepEvent]:
    """A healthy run whose loss keeps falling; the seed draws the batches' noise."""
    rng = random.Random(seed)
    out = []
    for t in range(start, stop):
        level = 0.9 + 3.0 * math.exp(-t / 700.0)
        out.append(
            StepEvent(
                run_id="r",
                step=t,
                epoch=epoch,
                time=0.0,
                loss=level * math.exp(rng.gauss(0.0, 0.01)),
                grad_norm=(0.5 + 1.5 * math.exp(-t / 500.0)) * math.exp(rng.gauss(0.0, 0.05)),
                lr=1e-3,
                update_norm=1e-3 * math.exp(rng.gauss(0.0, 0.05)),
                param_norm=50.0,
            )
        )
    return out


def flagged(verdicts: list[Verdict]) -> set[tuple[int, str]]:
    return {(v.step, v.type.value) for v in verdicts if v.is_anomaly}


@pytest.mark.parametrize("back", [50, 200, 1000])
@pytest.mark.parametrize("name", sorted(DETECTORS))
@pytest.mark.heavy
def test_a_rerun_after_a_rollback_raises_nothing_the_first_pass_did_not(name: str, back: int):
    det = DETECTORS[name](CONFIGS[name]())
    first = det.update_many(falling(0, FIRST_PASS, seed=1))
    target = FIRST_PASS - back  # a checkpoint step: the trainer checkpoints every 50
    # Re-run to where the first pass ended, with other batches (the bad ones are skipped).
    rerun = det.update_many(falling(target, FIRST_PASS, seed=2, epoch=1))
    assert all(v.epoch == 1 for v in rerun)
    assert flagged(rerun) <= flagged(first), sorted(flagged(rerun) - flagged(first))[:10]


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_the_same_steps_rerun_get_the_same_verdicts(name: str):
    # Same batches again after a rollback to a snapshot step: exactly the first verdicts.
    det = DETECTORS[name](CONFIGS[name]())
    events = falling(0, 1200, seed=3)
    first = det.update_many(events)
    rerun = det.update_many([e.model_copy(update={"epoch": 1}) for e in events[1000:]])
    assert [v.model_copy(update={"epoch": 0}) for v in rerun] == first[1000:]
    # A late step of the old epoch changes nothing and is not news.
    before = json.dumps(det.state_dict())
    late = det.update(events[1100])
    assert not late.is_anomaly and late.signals == {"stale": 1}
    assert json.dumps(det.state_dict()) == before


def test_a_new_epoch_that_reruns_nothing_keeps_the_state():
    det = DETECTORS["statistical"](CONFIGS["statistical"]())
    straight = DETECTORS["statistical"](CONFIGS["statistical"]())
    events = falling(0, 600, seed=6)
    det.update_many(events[:425])  # between two snapshots (400 and 450)
    straight.update_many(events[:425])
    later = det.update_many([e.model_copy(update={"epoch": 1}) for e in events[425:]])
    assert [v.model_copy(update={"epoch": 0}) for v in later] == straight.update_many(events[425:])
    assert det.state_dict() == {**straight.state_dict(), "epoch": 1}


def test_a_rollback_before_anything_kept_starts_afresh():
    det = DETECTORS["statistical"](CONFIGS["statistical"]())
    det.update_many(falling(0, 300, seed=4))
    det.history.clear()  # e.g. a worker restarted since: no snapshot goes back that far
    rerun = det.update_many(falling(100, 300, seed=5, epoch=1))
    assert flagged(rerun) == set()
    fresh = DETECTORS["statistical"](CONFIGS["statistical"]())
    assert fresh.update_many(falling(100, 300, seed=5, epoch=1)) == rerun
    assert fresh.state_dict() == det.state_dict()


def test_history_is_bounded_and_reaches_back_further_as_the_run_grows():
    history: StateHistory[int] = StateHistory(every=50, keep=16)
    for step in range(20_000):
        if history.due(step):
            history.save(step, step)
    steps = history.steps()
    assert len(steps) <= 16 and steps == sorted(steps)
    assert steps[-8:] == list(range(19_600, 20_000, 50))  # the newest stay dense
    assert steps[0] <= 20_000 - 5_000  # and the oldest reach back past a 5,000-step rollback
    assert history.rewind(18_030, lambda s: s) is not None
    assert max(history.steps()) <= 18_030


def test_rollback_through_the_worker_on_the_embedded_bus():
    from prometheus_client import CollectorRegistry

    from spikeguard.bus import EmbeddedBus
    from spikeguard.components import build_stage
    from spikeguard.metrics import Metrics
    from spikeguard.settings import load_settings
    from spikeguard.streaming.worker import Worker

    topics = Topics("rb.")
    bus = EmbeddedBus(partitions=1)
    stage = build_stage("statistical", load_settings(), topics)
    worker = Worker(bus, stage, metrics=Metrics(CollectorRegistry()), max_records=100)
    producer = bus.producer()
    for event in falling(0, FIRST_PASS, seed=1) + falling(FIRST_PASS - 200, FIRST_PASS, 2, 1):
        producer.publish(topics.steps, encode(event), key=event.run_id)
    while worker.run_once(timeout=0):
        pass
    verdicts = [decode(r.value, Verdict) for r in bus.read_all(topics.verdicts)]
    assert len(verdicts) == FIRST_PASS + 200
    assert [v for v in verdicts if v.is_anomaly] == []
