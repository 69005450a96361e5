"""The ``ml`` detector's layer view: a layer-local blow-up the total norm hides, named, acted on."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from spikeguard.lab.ablation import decide
from spikeguard.lab.layer_runs import layer_run
from spikeguard.processors.detectors.ml import MLConfig, MLDetector
from spikeguard.processors.detectors.ml.layers import LayerConfig, LayerShares
from spikeguard.processors.detectors.statistical import StatisticalDetector
from spikeguard.processors.fusion import Fusion
from spikeguard.schemas import AnomalyType, StepEvent, Verdict

T = AnomalyType
INJECT = 437


@pytest.fixture(scope="module")
def blowup_run():
    """A real torch model (5 Linear+LayerNorm blocks, AdamW); block 3's weights shrunk 6x at 437."""
    return layer_run(1, 600, inject_at=INJECT)


@pytest.mark.heavy
def test_real_model_layer_blowup_is_flagged_and_named_while_the_statistical_detector_is_quiet(
    blowup_run,
) -> None:
    events = blowup_run.events
    ml = MLDetector().update_many(events)
    flagged = [v for v in ml if v.type is T.LAYER_BLOWUP]
    assert flagged and flagged[0].step in (INJECT, INJECT + 1)
    first = flagged[0]
    assert first.is_anomaly and not first.critical and first.confidence >= 0.6
    assert first.signals["layer"] == blowup_run.layer == "blocks.3.0.weight"
    assert first.signals["share_before"] < 0.1 and first.signals["share"] > 0.4  # ~6 % -> ~70 %
    # the total norm hid it: it moved less than 2x, and the loss not at all
    assert first.signals["grad_ratio"] < 2.0
    assert events[INJECT].grad_norm < 2 * events[INJECT - 1].grad_norm
    assert "blocks.3.0.weight carries" in first.message
    # no layer alarm before the fault, and the alarm ends (the baseline follows a lasting shift)
    assert all(INJECT <= v.step < INJECT + 30 for v in flagged)
    # the statistical detector sees nothing in the whole run
    assert not any(v.is_anomaly for v in StatisticalDetector().update_many(events))


@pytest.mark.heavy
def test_fusion_acts_on_the_layer_blowup_alone(blowup_run) -> None:
    marks = decide(blowup_run.events, ("statistical", "rules", "ml", "predictor"))
    alarms = [m for m in marks if m.is_anomaly]
    assert alarms and all(m.type == "layer_blowup" for m in alarms)
    assert alarms[0].step in (INJECT, INJECT + 1)
    # without the ml detector the pipeline sees nothing at all
    assert not any(
        m.is_anomaly for m in decide(blowup_run.events, ("statistical", "rules", "predictor"))
    )


def test_a_layer_blowup_verdict_decides_at_full_weight_an_ml_outlier_does_not() -> None:
    def verdict(kind: AnomalyType, conf: float) -> Verdict:
        return Verdict(
            run_id="r", step=0, detector="ml", is_anomaly=True, type=kind, confidence=conf
        )

    for kind, anomalous in ((T.LAYER_BLOWUP, True), (T.ML_OUTLIER, False)):
        fusion = Fusion(run_id="r")
        (decision,) = fusion.add(verdict(kind, 0.6), 0.0) + fusion.flush()
        assert decision.is_anomaly is anomalous
        if anomalous:
            assert decision.type is T.LAYER_BLOWUP and decision.urgency.value == "low"  # 0.6 < 0.7
            assert decision.flagged_by == {"ml": T.LAYER_BLOWUP}


@pytest.mark.parametrize(("seed", "optimizer"), [(0, "adam"), (2, "sgd")])
@pytest.mark.heavy
def test_healthy_real_runs_raise_no_layer_alarm_and_no_incident(seed: int, optimizer: str) -> None:
    run = layer_run(seed, 600, optimizer=optimizer)
    assert all(len(e.top_grad_norms) == 5 for e in run.events)
    assert not any(v.type is T.LAYER_BLOWUP for v in MLDetector().update_many(run.events))
    marks = [
        m for m in decide(run.events, ("statistical", "rules", "ml", "predictor")) if m.is_anomaly
    ]
    # A small-batch run's heavy tail may show a single step far out (an outlier step: an alert, no
    # recovery; the Guard skips that update), at most 0.5 % of steps; never an incident.
    assert all(m.type == "outlier_step" for m in marks), marks
    assert len(marks) <= 0.005 * len(run.events)


def composition_stream(n: int, seed: int, jump_at: int | None = None) -> list[StepEvent]:
    """Eight layers with noisy shares (log-normal batch noise), one of them small; at ``jump_at``
    the small one takes ~45 % of the squared norm while the total moves ~1.6x."""
    rng = np.random.default_rng(seed)
    base = np.array([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.03, 0.02])
    events = []
    for i in range(n):
        sq = base * np.exp(0.3 * rng.standard_normal(len(base)))  # squared norms, ~30 % noise
        if jump_at is not None and jump_at <= i < jump_at + 20:
            sq[-1] *= 40.0
        total = float(np.sqrt(sq.sum() / (1.0 + 0.05 * rng.random())))  # + unreported layers
        norms = np.sqrt(sq)
        top = {f"layer{j}": float(norms[j]) for j in np.argsort(-norms)[:5]}
        events.append(
            StepEvent(
                run_id="c",
                step=i,
                time=float(i),
                loss=2.0 + 0.01 * rng.standard_normal(),
                grad_norm=total,
                lr=1e-3,
                top_grad_norms=top,
            )
        )
    return events


@pytest.mark.heavy
def test_small_layer_entering_the_top_k_is_judged_against_the_censored_floor() -> None:
    healthy = MLDetector().update_many(composition_stream(3000, seed=1))
    assert not any(v.type is T.LAYER_BLOWUP for v in healthy)
    verdicts = MLDetector().update_many(composition_stream(1500, seed=2, jump_at=1000))
    flagged = [v for v in verdicts if v.type is T.LAYER_BLOWUP]
    assert flagged[0].step == 1000 and flagged[0].signals["layer"] == "layer7"
    # layer7 (2 %) was never in the top 5 before: its baseline is the smallest reported share
    assert 0.03 < flagged[0].signals["share_before"] < 0.12 and flagged[0].signals["share"] > 0.3
    assert flagged[0].signals["grad_ratio"] < 2.0
    assert all(1000 <= v.step < 1020 for v in flagged)


@pytest.mark.heavy
def test_update_many_equals_update_and_json_state_restarts_exactly(blowup_run) -> None:
    events = blowup_run.events
    singles = [d.update(e) for d in [MLDetector()] for e in events]
    batched = MLDetector()
    out = []
    for i in range(0, len(events), 64):
        out += batched.update_many(events[i : i + 64])
    assert out == singles
    for cut in (50, INJECT):  # during the layer warm-up, and just before the blow-up
        first = MLDetector()
        before = first.update_many(events[:cut])
        second = MLDetector()
        second.load_state_dict(json.loads(json.dumps(first.state_dict())))
        assert before + second.update_many(events[cut:]) == singles


def test_shares_need_two_finite_layers_and_a_positive_total() -> None:
    assert LayerShares.shares(2.0, {"a": 1.0}) is None
    assert LayerShares.shares(None, {"a": 1.0, "b": 1.0}) is None
    assert LayerShares.shares(math.inf, {"a": 1.0, "b": 1.0}) is None
    assert LayerShares.shares(0.0, {"a": 1.0, "b": 1.0}) is None
    assert LayerShares.shares(2.0, {"a": 1.0, "b": math.nan}) is None
    assert LayerShares.shares(2.0, {"a": 1.0, "b": 1.0}) == {"a": 0.25, "b": 0.25}


def test_tracked_layers_are_bounded() -> None:
    model = LayerShares(LayerConfig(max_layers=4, warmup_steps=2))
    for i in range(50):
        model.learn(10.0, {f"l{i}": 5.0, f"m{i}": 4.0, "big": 8.0})
    assert len(model.layers) == 4 and "big" in model.layers
    assert (
        len(json.dumps(MLDetector(MLConfig(layers=LayerConfig(max_layers=4))).state_dict()))
        < 10_000
    )


class _EveryRow(MLDetector):
    """The detector as it was: every step's feature row computed, read or not."""

    def _rows_unread(self, state) -> bool:
        return False


def test_without_the_forest_a_run_with_layer_norms_keeps_its_rows() -> None:
    events = composition_stream(600, seed=1, jump_at=450)
    fast, full = MLDetector(), _EveryRow()
    got = [v for i in range(0, 600, 100) for v in fast.update_many(events[i : i + 100])]
    want = [v for i in range(0, 600, 100) for v in full.update_many(events[i : i + 100])]
    assert [v.model_dump() for v in got] == [v.model_dump() for v in want]
    assert any(v.type is AnomalyType.LAYER_BLOWUP and "loss_z" in v.signals for v in got)
    assert fast.state.features._loss.n == full.state.features._loss.n
