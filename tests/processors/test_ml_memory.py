"""The ``ml`` detector at 10,000 runs a worker: what a run holds, and that holding less changes no verdict."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from spikeguard.processors.detectors.ml import MLConfig, MLDetector, MLState
from spikeguard.processors.features import RollingFeatures
from spikeguard.schemas import StepEvent
from spikeguard.streaming.footprint import deep_size
from spikeguard.streaming.state_store import DEFAULT_MAX_RECORD_BYTES

# The buffer fills after 3 fits; then refit_every > buffer_size, so rows are skipped.
#: The forest is off by default; these tests are about the memory it holds when on.
FOREST = MLConfig(forest=True)
SMALL = MLConfig(forest=True, warmup_steps=64, buffer_size=128, refit_every=300, n_estimators=20)


def stream(n: int, seed: int = 0, epoch: int = 0, start: int = 0) -> list[StepEvent]:
    """A healthy run (falling loss, heavy-tailed noise) with a spike every 97 steps."""
    rng = np.random.default_rng(seed)
    t = np.arange(start, start + n)
    loss = 2.5 + 2.0 * np.exp(-t / 300) + 0.02 * rng.standard_t(5, n)
    loss[t % 97 == 3] *= 1.5
    grad = np.exp(np.log(0.5) + 0.05 * rng.standard_normal(n))
    return [
        StepEvent(
            run_id="r",
            step=int(s),
            epoch=epoch,
            time=0.0,
            loss=float(loss[i]),
            grad_norm=float(grad[i]),
            lr=1e-3,
        )
        for i, s in enumerate(t)
    ]


def batched(det: MLDetector, events: list[StepEvent], size: int = 250) -> list:
    return [v for i in range(0, len(events), size) for v in det.update_many(events[i : i + size])]


class Recording(MLDetector):
    """Remembers every row it learnt from: what the buffer should be made of."""

    def __init__(self, config: MLConfig) -> None:
        self.learnt: list[np.ndarray] = []
        super().__init__(config)

    def learn(self, event: StepEvent, state: MLState) -> None:
        if state.healthy:
            self.learnt.append(state.row.astype(np.float32))
        super().learn(event, state)


def test_the_forest_is_fitted_on_the_newest_rows_though_older_ones_are_not_kept() -> None:
    det = Recording(SMALL)
    batched(det, stream(2500, seed=1))
    assert det.state.fits >= 7  # three while the buffer fills, then every 300 rows
    assert np.array_equal(
        det.state.fitted, np.array(det.learnt[: len(det.learnt) - det.state.since])[-128:]
    )
    # Of the rows since the fit, only those the next fit takes are held.
    assert len(det.state.pending) == max(0, det.state.since - (300 - 128))
    assert len(det.state_dict()["pending"]) <= SMALL.buffer_size


def test_a_state_of_version_2_loads_and_judges_the_same() -> None:
    """Version 2 kept every row since the fit: it loads, keeping those the next fit takes."""
    events = stream(1800, seed=2)
    straight = batched(Recording(SMALL), events)
    first = Recording(SMALL)
    before = batched(first, events[:1234])
    old = json.loads(json.dumps(first.state_dict()))
    since = old.pop("since_fit")
    assert since - len(old["pending"]) > 0  # rows were skipped: the old layout had them all
    old["pending"] = [r.tolist() for r in first.learnt[len(first.learnt) - since :]]
    old["version"] = 2
    second = MLDetector(SMALL)
    second.load_state_dict(old)
    assert before + batched(second, events[1234:]) == straight


def test_a_batch_computes_each_steps_features_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    update = RollingFeatures.update

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return update(self, *args, **kwargs)

    monkeypatch.setattr(RollingFeatures, "update", counted)
    events = stream(1000, seed=3)
    det = MLDetector(SMALL)
    batched(det, events)
    assert calls[0] == len(events)  # it was twice that: once ahead, once in place


@pytest.mark.parametrize("size", [1, 7, 250])
def test_snapshots_taken_inside_batches_put_back_the_same_state(size: int) -> None:
    """Rollbacks to snapshots inside batches: every batch size judges the re-run alike."""

    def run(size: int) -> tuple[list, dict]:
        det = MLDetector(SMALL)
        out = batched(det, stream(1400, seed=4), size)
        out += batched(det, stream(300, seed=5, epoch=1, start=1150), size)  # back 250 steps
        out += batched(det, stream(500, seed=6, epoch=2, start=1400), size)  # back 50
        return out, det.state_dict()

    assert run(size) == run(1000)


def test_a_released_forest_comes_back_the_same() -> None:
    events = stream(2000, seed=7)
    kept = MLDetector(SMALL)
    straight = batched(kept, events)
    det = MLDetector(SMALL)
    out = []
    for i in range(0, len(events), 100):  # quiet between every batch
        out += det.update_many(events[i : i + 100])
        was_fitted = det.state.forest is not None
        assert det.release() == was_fitted and det.state.forest is None
        assert det.release() is False
    assert out == straight
    assert det.state.fits == kept.state.fits
    forest = det.state.forest or det._forest(det.state)
    for name in ("left", "right", "feature", "threshold", "leaf_value", "roots"):
        assert np.array_equal(getattr(forest, name), getattr(kept.state.forest, name)), name


@pytest.fixture(scope="module")
def default_run() -> dict:
    """Default settings, 5000 steps in batches of 10 (a worker's batch of many runs): what the
    run holds every 100 steps, and its state just before a refit with a full buffer (the most
    rows it ever holds)."""
    det = MLDetector(FOREST)
    events = stream(5000, seed=8)
    out: dict = {"sizes": []}
    for i in range(0, len(events), 10):
        det.update_many(events[i : i + 10])
        if (i + 10) % 100 == 0:
            out["sizes"].append(deep_size(det))
        if "largest" not in out and det.state.fits == 6 and det.state.since >= 2950:
            out["largest"] = (det.state_dict(), i + 10)  # refit 7 comes at 3000
    assert det.state.fits == 7
    return out


@pytest.mark.heavy
def test_the_json_state_at_its_largest_fits_a_state_record(default_run: dict) -> None:
    state, _ = default_run["largest"]
    assert len(state["fitted"]) == 1024 and len(state["pending"]) > 900  # nearly two buffers
    size = len(json.dumps(state).encode())
    assert size < 100_000 < DEFAULT_MAX_RECORD_BYTES  # ~160 kB before: it kept all 3000


def test_10000_runs_fit_in_1_GiB(default_run: dict) -> None:
    """Forest ~36 kB, float32 rows (the forest's, the next fit's, and after a refit the previous
    fit's, which the rollback snapshots keep), features, layers and snapshot heads: ~600 kB
    a run before, most of it the padded float64 forest and 3000 rows of float64 per fit."""
    sizes = default_run["sizes"]
    assert max(sizes) < 2**30 / 10_000  # at every point of the run's life
    assert np.mean(sizes[15:]) < 95_000  # once the buffer is full


def test_the_largest_state_round_trips_through_json(default_run: dict) -> None:
    state, at = default_run["largest"]
    restored = MLDetector(FOREST)
    restored.load_state_dict(json.loads(json.dumps(state)))
    twin = MLDetector(FOREST)
    events = stream(5000, seed=8)
    batched(twin, events[:at], 10)
    more = events[at : at + 500]  # a refit among them
    assert batched(restored, more) == batched(twin, more)
    assert restored.state.fits == 7 and math.isfinite(restored.state.threshold)


def test_the_ml_worker_releases_quiet_runs_forests_and_judges_them_the_same() -> None:
    from spikeguard.processors.detectors.ml.stage import MLStage
    from spikeguard.schemas import Topics

    topics = Topics("t.")
    a = [e.model_copy(update={"run_id": "a"}) for e in stream(1600, seed=10)]
    b = [e.model_copy(update={"run_id": "b"}) for e in stream(1600, seed=11)]

    def verdicts(stage: MLStage, events: list[StepEvent], now: float) -> list:
        stage.touch({e.run_id for e in events}, now)
        out = stage.handle_batch([(topics.steps, e) for e in events])
        stage.tick(now)
        return [v for _, v in out]

    stage = MLStage(topics, lambda run_id: MLDetector(SMALL), release_idle_s=60.0)
    kept = MLStage(topics, lambda run_id: MLDetector(SMALL), release_idle_s=1e9)
    first = verdicts(stage, a[:1000] + b[:1000], now=0.0)
    assert first == verdicts(kept, a[:1000] + b[:1000], now=0.0)
    assert verdicts(stage, b[1000:1200], now=50.0) == verdicts(kept, b[1000:1200], now=50.0)
    assert stage.runs["a"].state.forest is not None  # quiet for 50 s: kept
    assert stage.tick(100.0) == [] and stage.released == 1  # a quiet for 100 s, b for 50 s
    assert stage.runs["a"].state.forest is None and stage.runs["b"].state.forest is not None
    stage.tick(110.0)
    assert stage.released == 1  # swept at 100 s: the next sweep is due at 115 s
    stage.tick(120.0)
    assert stage.released == 2 and stage.runs["b"].state.forest is None
    assert stage.runs["a"].state.fits > 0  # its rows stay: the forest comes back from them
    rest = a[1000:] + b[1200:]
    assert verdicts(stage, rest, now=120.0) == verdicts(kept, rest, now=120.0)
    assert stage.runs["a"].state.forest is not None


EARLY = MLConfig(forest=True, warmup_steps=32, buffer_size=256, refit_every=300, n_estimators=10)


@pytest.mark.parametrize("target", [100, 150, 250, 400])
def test_rollbacks_while_the_buffer_fills_judge_as_a_fresh_run_would(target: int) -> None:
    """Early fits share one block of rows: a rollback into them, then other rows, changes none
    of what the snapshots hold (a fresh detector fed the same steps agrees)."""
    first = stream(450, seed=12)
    rerun = stream(300, seed=13, epoch=1, start=target)
    det = MLDetector(EARLY)
    blocks = []
    for i in range(0, len(first), 25):
        det.update_many(first[i : i + 25])
        blocks.append(det.state.fitted)
    shared = [
        a for a, b in zip(blocks, blocks[1:]) if len(a) and a is not b and np.shares_memory(a, b)
    ]
    assert len(shared) >= 3  # successive fits' rows are windows of one block
    fresh = MLDetector(EARLY)
    batched(fresh, first[:target], 25)
    assert batched(det, rerun, 25) == batched(fresh, rerun, 25)
    assert det.state_dict() == fresh.state_dict()


@pytest.mark.heavy
def test_an_ml_worker_restarted_from_its_largest_state_records_judges_on_alike() -> None:
    """Through a real worker and its state topic: the records at their largest (a full buffer
    and nearly another) stay far below the record limit, and a new worker restored from them
    gives the verdicts an uninterrupted worker gives."""
    from prometheus_client import CollectorRegistry

    from spikeguard.bus import EmbeddedBus
    from spikeguard.components import build_stage
    from spikeguard.metrics import Metrics
    from spikeguard.schemas import Topics, Verdict, decode
    from spikeguard.settings import load_settings
    from spikeguard.streaming.worker import Worker

    topics = Topics("mlw.")
    settings = load_settings({"topic_prefix": topics.prefix, "ml": {"forest": True}}, env={})
    runs = {
        run: [e.model_copy(update={"run_id": run}) for e in stream(4500, seed=8)] for run in "ab"
    }
    cut = 4220  # 6 fits, and 2957 of the 3000 rows before the 7th

    def publish(bus: EmbeddedBus, lo: int, hi: int) -> None:
        bus.producer().publish_events(
            (topics.steps, runs[run][i]) for i in range(lo, hi) for run in runs
        )

    def worker(bus: EmbeddedBus, **kwargs) -> Worker:  # type: ignore[no-untyped-def]
        w = Worker(
            bus, build_stage("ml", settings, topics), metrics=Metrics(CollectorRegistry()), **kwargs
        )
        return w

    def drain(w: Worker) -> None:
        while w.run_once(timeout=0):
            pass

    def judged(bus: EmbeddedBus) -> dict:
        out: dict = {}
        for record in bus.read_all(topics.verdicts):
            v = decode(record.value, Verdict)
            assert (v.run_id, v.step) not in out  # each step judged once
            out[(v.run_id, v.step)] = (v.is_anomaly, v.type, v.signals)
        return out

    reference = EmbeddedBus(partitions=1)
    publish(reference, 0, 4500)
    drain(worker(reference))

    bus = EmbeddedBus(partitions=1)
    publish(bus, 0, cut)
    first = worker(bus, snapshot_interval_s=3600)
    drain(first)
    first.checkpoint()
    first._consumer.close()  # gone: the next worker starts from the saved state
    records = {r.key.decode(): r.value for r in bus.read_all(topics.state("ml")) if r.value}
    saved = json.loads(records["ml/run/a"])["state"]
    assert saved["fits"] == 6 and saved["since_fit"] >= 2950 and len(saved["pending"]) > 900
    assert max(map(len, records.values())) < 110_000 < settings.worker.max_state_record_bytes
    publish(bus, cut, 4500)
    second = worker(bus, snapshot_interval_s=3600)
    drain(second)
    assert second.stage.runs["a"].state.fits == 7  # refitted after the restart
    assert judged(bus) == judged(reference)
