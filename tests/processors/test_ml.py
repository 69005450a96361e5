"""The ``ml`` detector: warm-up, outliers, batching without look-ahead, restarts, bounds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError
from sklearn.ensemble import IsolationForest

from spikeguard.processors.detectors.ml import CompiledForest, MLConfig, MLDetector
from spikeguard.processors.features import ML_FEATURES
from spikeguard.schemas import AnomalyType, StepEvent

# Small forests and buffers keep the tests fast; the logic is the same at any size.
SMALL = MLConfig(forest=True, warmup_steps=64, buffer_size=128, refit_every=100, n_estimators=20)


def stream(
    n: int, seed: int = 0, spikes: tuple[int, ...] = (), run_id: str = "r"
) -> list[StepEvent]:
    """A healthy-looking run (decaying loss, t-distributed noise, noisy grad norm) plus spikes."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    loss = 2.5 + 2.0 * np.exp(-t / 200) + 0.02 * rng.standard_t(6, n)
    grad = np.exp(np.log(0.5) + 0.05 * rng.standard_normal(n))
    for s in spikes:
        loss[s] *= 1.6  # ~60 noise s.d.: a real spike
        grad[s] *= 20
    return [
        StepEvent(
            run_id=run_id,
            step=i,
            time=float(i),
            loss=float(loss[i]),
            grad_norm=float(grad[i]),
            lr=1e-3,
        )
        for i in range(n)
    ]


def run_in_batches(det: MLDetector, events: list[StepEvent], size: int) -> list:
    out = []
    for i in range(0, len(events), size):
        out += det.update_many(events[i : i + size])
    return out


def test_warmup_verdicts_say_so_and_never_alarm() -> None:
    verdicts = MLDetector(SMALL).update_many(stream(60))
    assert all(
        not v.is_anomaly and v.confidence == 0.0 and v.signals == {"warmup": 1} for v in verdicts
    )
    assert all(v.detector == "ml" and v.run_id == "r" for v in verdicts)


def test_every_verdict_carries_its_step_s_values() -> None:
    # Warm-up, forest off, non-finite: fusion's evidence reads them, with no copy made downstream.
    events = stream(70)
    events[65] = events[65].model_copy(update={"loss": math.nan})
    for config in (SMALL, MLConfig()):
        verdicts = MLDetector(config).update_many(events)
        assert [v.grad_norm for v in verdicts] == [e.grad_norm for e in events]
        assert [v.loss for v in verdicts][:65] == [e.loss for e in events][:65]
        assert math.isnan(verdicts[65].loss)  # type: ignore[arg-type]


def test_flags_a_spike_and_stays_mostly_quiet_otherwise() -> None:
    events = stream(1500, seed=1, spikes=(700, 1200))
    verdicts = MLDetector(SMALL).update_many(events)
    for s in (700, 1200):
        v = verdicts[s]
        assert v.is_anomaly and v.type is AnomalyType.ML_OUTLIER
        assert v.confidence > 0.5 and not v.critical
        assert v.signals["score"] > v.signals["threshold"]
    quiet = [v for v in verdicts[300:] if v.step not in (700, 701, 1200, 1201)]
    assert sum(v.is_anomaly for v in quiet) / len(quiet) < 0.02
    assert all(
        not v.is_anomaly and v.confidence <= 0.5
        for v in quiet
        if v.signals["score"] <= v.signals["threshold"]
    )


def test_non_finite_is_an_outlier_and_teaches_nothing() -> None:
    events = stream(600, seed=2)
    nan_step = 400
    bad = events[nan_step].model_copy(update={"loss": math.nan})
    with_nan = events[:nan_step] + [bad] + events[nan_step + 1 :]
    without = events[:nan_step] + events[nan_step + 1 :]
    a = MLDetector(SMALL).update_many(with_nan)
    b = MLDetector(SMALL).update_many(without)
    v = a[nan_step]
    assert (
        v.is_anomaly and v.type is AnomalyType.ML_OUTLIER and v.confidence >= 0.9 and not v.critical
    )
    assert v.signals == {"non_finite": 1}
    # Neither the rolling features nor the training buffer saw it: every other verdict is the same.
    assert a[:nan_step] + a[nan_step + 1 :] == b
    inf_grad = events[10].model_copy(update={"grad_norm": math.inf})
    assert MLDetector(SMALL).update(inf_grad).is_anomaly  # even before any fit


def test_update_and_update_many_agree_with_refits_inside_batches() -> None:
    events = stream(900, seed=3, spikes=(300, 650))
    one = MLDetector(SMALL)
    singles = [one.update(e) for e in events]
    batched = MLDetector(SMALL)
    assert run_in_batches(batched, events, 97) == singles
    assert one.state.fits == batched.state.fits >= 5  # fits happened, at the same steps either way
    assert sum(v.is_anomaly for v in singles) >= 2


def test_restart_from_json_state_gives_identical_verdicts() -> None:
    events = stream(800, seed=4, spikes=(500,))
    straight = run_in_batches(MLDetector(SMALL), events, 50)
    for cut in (40, 333):  # during warm-up, and between refits
        first = MLDetector(SMALL)
        before = run_in_batches(first, events[:cut], 50)
        state = json.loads(json.dumps(first.state_dict()))
        second = MLDetector(SMALL)
        second.load_state_dict(state)
        assert before + run_in_batches(second, events[cut:], 50) == straight


def test_state_is_bounded_whatever_the_run_length() -> None:
    det = MLDetector(SMALL)
    run_in_batches(det, stream(3000, seed=5), 500)
    state = det.state_dict()
    assert len(state["fitted"]) <= SMALL.buffer_size
    assert len(state["pending"]) < max(SMALL.warmup_steps, SMALL.refit_every)
    assert all(len(row) == len(ML_FEATURES) for row in state["fitted"])


def test_compiled_forest_matches_sklearn_scores() -> None:
    rng = np.random.default_rng(6)
    train = rng.normal(size=(300, len(ML_FEATURES)))
    probe = np.vstack(
        [rng.normal(size=(50, len(ML_FEATURES))), 6 * rng.normal(size=(50, len(ML_FEATURES)))]
    )
    forest = IsolationForest(n_estimators=30, max_samples=128, random_state=3).fit(train)
    compiled = CompiledForest(forest)
    ours = np.array([compiled.score(s) for s in compiled.path_sums(probe)])
    np.testing.assert_allclose(ours, -forest.score_samples(probe), atol=1e-6)
    # Sums are exact: scoring rows one by one gives the very same numbers.
    one_by_one = [compiled.path_sums(probe[i : i + 1])[0] for i in range(len(probe))]
    assert one_by_one == compiled.path_sums(probe).tolist()


def test_rollback_epochs() -> None:
    events = stream(300, seed=7)
    det = MLDetector(SMALL)
    det.update_many(events[:200])
    rerun = [e.model_copy(update={"epoch": 1}) for e in events[150:160]]
    assert [v.epoch for v in det.update_many(rerun)] == [1] * 10
    before = json.dumps(det.state_dict())
    late = det.update(events[200])  # epoch 0 arriving after the rollback: a stale duplicate
    assert not late.is_anomaly and late.signals == {"stale": 1}
    assert json.dumps(det.state_dict()) == before


@pytest.mark.parametrize(
    ("field", "value"),
    [("n_estimators", 0), ("threshold_quantile", 1.5), ("buffer_size", 3), ("bogus", 1)],
)
def test_bad_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        MLConfig(**{field: value})


def test_absurd_finite_values_neither_crash_nor_poison_the_run() -> None:
    events = stream(700, seed=8)
    for i, loss in ((5, 1e300), (12, -1e300), (500, 1e300)):
        events[i] = events[i].model_copy(update={"loss": loss})
    events[9] = events[9].model_copy(update={"grad_norm": 1e300})
    det = MLDetector(SMALL)
    verdicts = det.update_many(events)
    assert verdicts[500].is_anomaly and verdicts[500].confidence > 0.5
    assert sum(v.is_anomaly for v in verdicts[300:]) <= 10
    assert np.isfinite(np.array(det.state_dict()["fitted"])).all()


@pytest.mark.parametrize(("n", "seed"), [(50, 5), (300, 3), (1024, 17)])
def test_fit_forest_grows_exactly_the_trees_isolation_forest_grows(n: int, seed: int) -> None:
    from spikeguard.processors.detectors.ml.forest import fit_forest

    rng = np.random.default_rng(n)
    rows = np.round(rng.normal(size=(n, len(ML_FEATURES))), 4)
    reference = CompiledForest(
        IsolationForest(n_estimators=30, max_samples=min(256, n), random_state=seed).fit(rows)
    )
    ours = fit_forest(rows, 30, 256, seed)
    for name in ("left", "right", "feature", "threshold", "leaf_value"):
        assert np.array_equal(getattr(ours, name), getattr(reference, name)), name
    assert ours.norm == reference.norm and ours.depth == reference.depth


class _EveryRow(MLDetector):
    """The detector as it was: every step's feature row computed, read or not."""

    def _rows_unread(self, state) -> bool:
        return False


@pytest.mark.parametrize("size", [1, 7, 500])
def test_without_the_forest_a_warm_run_skips_its_rows_with_the_same_verdicts(size: int) -> None:
    events = stream(1500, seed=3, spikes=(400, 900))
    events[700] = events[700].model_copy(update={"loss": math.nan})
    fast, full = MLDetector(), _EveryRow()
    assert not fast.config.forest  # the default
    got, want = run_in_batches(fast, events, size), run_in_batches(full, events, size)
    assert [v.model_dump() for v in got] == [v.model_dump() for v in want]
    assert {next(iter(v.signals)) for v in got} == {"warmup", "forest_off", "non_finite"}
    # The features stopped once ready (a batch computed ahead ends the batch it is in).
    ready_at = fast.config.features.min_steps
    assert fast.state.features._loss.n <= ready_at + size < full.state.features._loss.n == 1499
