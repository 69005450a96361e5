"""The ``ml`` detector: a run's layer-share composition and an isolation forest over its healthy steps.

Two views, one verdict per step:

* **Layer shares** (:mod:`.ml_layers`): when a step carries per-layer gradient
  norms, each reported layer's share of the squared total norm is compared with
  its own baseline. One layer taking most of the gradient while the total norm
  moves < 2x and the loss not at all is a ``LAYER_BLOWUP``, naming the layer and
  its share before and after. Fusion counts this verdict at full weight
  (:data:`~spikeguard.processors.decision_table.FULL_WEIGHT_TYPES`): no other
  detector sees it, so it must be able to decide alone.
* **Isolation forest**: per run, it learns what ordinary steps look like in a
  scale-free feature space (loss residual, step change, volatility ratio,
  grad-norm residual, update-size residual; see
  :mod:`spikeguard.processors.features`), clamped below so that a falling loss
  or a calm stretch is never "unusual", and calls a step an ``ML_OUTLIER`` when
  its anomaly score passes a threshold calibrated at each fit. One voice among
  several (fusion weight 0.5): never critical, never alone.

Forest calibration: a forest's scores saturate — a row beyond every training
extreme scores about the same as the most extreme training rows — so the
threshold is placed ``threshold_margin`` of the way from a high quantile of the
training scores to that ceiling (the score of a row just beyond all of them).
Confidence is 0.5 at the threshold and 1 at the ceiling.

Lifecycle: warm-up (``is_anomaly=False``, ``confidence=0``,
``signals={"warmup": 1}``) until ``warmup_steps`` healthy rows are buffered;
fit; refit every ``warmup_steps`` healthy rows until the buffer is full (a
young run drifts fast), then every ``refit_every`` (3000: a fit costs ~0.1 s,
so it costs ~30 us a step, and the rolling features already follow the
run in between). "Healthy" is judged by the rolling baselines (every residual
within ``healthy_gate_z``), not by the forest: a buffer that only admits what
the forest likes stops following a drifting run, and then the forest flags
everything. A non-finite step never enters features or buffer and is an outlier
with ``nonfinite_confidence``.

Batching without look-ahead: features depend only on earlier events (never on
verdicts), so ``update_many`` computes the batch's rows first, in one pass over
a copy of the features and one vectorised clean-up, scores them with the current
forest in one walk, and rescores the rest of the batch only when a refit happens
inside it; each step then advances the real features in place. ``update`` walks
the forest for its one row: both give identical verdicts. The forest is never
pickled: ``state_dict`` keeps its rows, the rows since and the fit count, and
``load_state_dict`` refits (same rows + seed => same trees). State is bounded:
``buffer_size + max(warmup_steps, refit_every)`` rows of five floats (40 bytes
a row in memory, ~160 kB of JSON at most), ``layers.max_layers`` share tracks.
"""

from __future__ import annotations

import math
import pickle
from typing import Any, ClassVar, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from spikeguard.processors.detectors.base import Detector, validate_verdict
from spikeguard.processors.detectors.ml_forest import CompiledForest, fit_forest
from spikeguard.processors.detectors.ml_layers import LayerConfig, LayerFinding, LayerShares
from spikeguard.processors.detectors.ml_rows import Rows
from spikeguard.processors.features import ML_FEATURES, FeatureConfig, RollingFeatures
from spikeguard.schemas import AnomalyType, StepEvent, Verdict

__all__ = ["CompiledForest", "MLConfig", "MLDetector", "MLState"]

_BOUND = 1e6  # keeps extreme-but-finite features finite in float32
_WIDTH = len(ML_FEATURES)
_RESIDUALS = [ML_FEATURES.index(n) for n in ("loss_z", "loss_step", "grad_z", "update_z")]


class MLConfig(BaseModel):
    """Defaults: 50 trees x 256 rows and a refit every 3000 healthy steps keep it above
    20k steps/s; the threshold flags ~0.5 % of the (heavy-tailed) real NanoGPT steps,
    nearly all of them real upward jumps, and ~0.1 % of simulated healthy steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    features: FeatureConfig = Field(default_factory=FeatureConfig, description="rolling features")
    layers: LayerConfig = Field(
        default_factory=LayerConfig, description="layer-share model (steps with per-layer norms)"
    )
    warmup_steps: int = Field(
        200, ge=16, description="healthy rows before the first fit, and between early refits"
    )
    buffer_size: int = Field(1024, ge=16, description="newest healthy rows the forest is fitted on")
    refit_every: int = Field(
        3000, ge=16, description="healthy rows between refits once the buffer is full: a fit costs "
        "~0.1 s, so 3000 keeps it near 30 us a step, and the features follow the run between"
    )
    n_estimators: int = Field(50, ge=1, le=1000, description="trees in the forest")
    max_samples: int = Field(256, ge=2, description="rows drawn per tree (depth limit log2 of it)")
    random_state: int = Field(0, ge=0, description="seed; fit number n uses random_state + n - 1")
    threshold_quantile: float = Field(
        0.995, gt=0.5, lt=1.0, description="quantile of the training scores the threshold starts at"
    )
    threshold_margin: float = Field(
        0.75, ge=0.0, lt=1.0, description="fraction of the way from there to the score ceiling"
    )
    healthy_gate_z: float = Field(
        6.0, gt=0.0, description="a row may train the forest when no residual exceeds this (s.d.)"
    )
    downside_clip: float = Field(
        1.0, ge=0.0, description="features are clamped at minus this: only the upward side is news"
    )
    nonfinite_confidence: float = Field(
        0.95, ge=0.0, le=1.0, description="confidence of the verdict on a NaN/Inf step"
    )


def _clean(raw: np.ndarray) -> np.ndarray:
    """Rows (or one row) made finite and bounded, rounded so the buffer is exact and short in
    JSON (far below the noise). Elementwise: a batch's matrix gives each row's own result."""
    raw = np.nan_to_num(raw, nan=0.0, posinf=_BOUND, neginf=-_BOUND).clip(-_BOUND, _BOUND)
    return np.round(raw, 4)


class _Batch:
    """A batch's rows, computed ahead on one copy of the features, and their forest path sums.

    ``items[i]`` is the i-th step's row index in ``rows``, or why it has none. Exact: the
    rows come from the same feature updates the steps then apply in place, and leaf path
    lengths are rounded so that sums do not depend on the batch.
    """

    def __init__(self, state: MLState, events: Sequence[StepEvent], floor: float) -> None:
        ahead = state.features.copy()
        raws: list[list[float]] = []
        self.items: list[int | str] = []
        for event in events:
            if not event.finite:
                self.items.append("non_finite")  # never enters the features
                continue
            f = ahead.update_event(event)
            if f is None:
                self.items.append("warmup")
            else:
                self.items.append(len(raws))
                raws.append(f.ml_vector(floor))
        self.rows = _clean(np.array(raws, dtype=np.float64).reshape(-1, _WIDTH))
        self.cursor = 0  # the step being judged
        self._forest: CompiledForest | None = None
        self._first = 0
        self._sums: list[float] = []

    def path_sum(self, i: int, forest: CompiledForest) -> float:
        if forest is not self._forest or i < self._first:  # first use, or a refit since
            self._forest, self._first = forest, i
            self._sums = forest.path_sums(self.rows[i:]).tolist()
        return self._sums[i - self._first]


class MLState:
    """One run's features, the forest's training rows, the forest, and the layer-share model."""

    __slots__ = ("features", "fitted", "pending", "fits", "forest", "threshold", "median",
                 "ceiling", "row", "healthy", "layers")

    def __init__(self, features: RollingFeatures, layers: LayerShares) -> None:
        self.features = features
        self.layers = layers
        self.fitted = np.zeros((0, _WIDTH))  # rows the current forest was fitted on
        self.pending = Rows(_WIDTH)  # healthy rows since that fit
        self.fits = 0
        self.forest: CompiledForest | None = None
        self.threshold = self.median = self.ceiling = math.nan  # in score units
        self.row: np.ndarray | None = None  # the last step's row (what learn() needs)
        self.healthy = False  # ... and whether it may train the forest


def _shares(event: StepEvent) -> dict[str, float] | None:
    if not event.top_grad_norms or not event.finite:  # the usual case: one cheap test
        return None
    return LayerShares.shares(event.grad_norm, event.top_grad_norms)


class MLDetector(Detector[MLState]):
    name: ClassVar[str] = "ml"
    state_version: ClassVar[int] = 2  # 2: the layer-share model

    def __init__(self, config: MLConfig | None = None) -> None:
        self.config = config or MLConfig()
        super().__init__()

    def fresh(self) -> MLState:
        return MLState(RollingFeatures(self.config.features), LayerShares(self.config.layers))

    _batch: _Batch | None = None

    # -- judging -------------------------------------------------------------
    def _row(self, event: StepEvent, state: MLState) -> tuple[np.ndarray | str, RollingFeatures]:
        """The step's feature row (or why there is none), and the features after the step."""
        if not event.finite:
            return "non_finite", state.features  # never enters the features nor the buffer
        f, after = state.features.peek_event(event)
        if f is None:
            return "warmup", after
        return _clean(np.array(f.ml_vector(-self.config.downside_clip), dtype=np.float64)), after

    def _current(self, event: StepEvent, state: MLState) -> np.ndarray | str:
        batch = self._batch
        if batch is None:
            return self.scored(event, state, self._row)[0]
        item = batch.items[batch.cursor]
        return item if isinstance(item, str) else batch.rows[item]

    def update_many(self, events: Sequence[StepEvent]) -> list[Verdict]:
        # The rows of a batch are known before any of it is judged (features depend on
        # earlier events only, never on verdicts), so the forest walks them in one pass.
        if len(events) < 2 or any(event.epoch != self.epoch for event in events):
            return super().update_many(events)
        batch = self._batch = _Batch(self.state, events, -self.config.downside_clip)
        out = []
        try:
            for i, event in enumerate(events):
                batch.cursor = i
                out.append(self.update(event))
        finally:
            self._batch = None
        return out

    def score(self, event: StepEvent, state: MLState) -> Verdict:
        row = self._current(event, state)
        if isinstance(row, str) and row == "non_finite":
            return self._plain(event, row)
        shares = _shares(event)
        if shares is not None:
            found = state.layers.judge(event.grad_norm, shares)
            if found is not None and found.blowup:
                return self._blowup(event, state, found, row)
        if isinstance(row, str):
            return self._plain(event, row)
        forest = state.forest
        if forest is None:
            return self._plain(event, "warmup")
        batch = self._batch
        if batch is None:
            path_sum = float(forest.path_sums(row[None, :])[0])
        else:
            path_sum = batch.path_sum(batch.items[batch.cursor], forest)
        return self._judged(event, state, forest.score(path_sum), float(row[0]))

    def track(self, event: StepEvent, state: MLState, verdict: Verdict) -> None:
        if self._batch is None:
            row, state.features = self.scored(event, state, self._row)
        else:  # the batch computed the row ahead: advance the features in place, no copy
            row = self._current(event, state)
            if event.finite:
                state.features.update_event(event)
        state.row = None if isinstance(row, str) else row
        # Healthy (may train the forest): no residual beyond what the rolling baselines call
        # normal. Judged without the forest, so that the buffer keeps following a drifting run.
        state.healthy = (
            state.row is not None
            and bool(row[_RESIDUALS].max() <= self.config.healthy_gate_z)
            and verdict.type is not AnomalyType.LAYER_BLOWUP
        )
        shares = _shares(event)
        if shares is not None:  # winsorized: a blow-up cannot drag its own baseline
            state.layers.learn(event.grad_norm, shares)

    def protects(self, verdict: Verdict) -> bool:
        # The forest's own verdict does not gate its training rows: a buffer that
        # admits only what the forest likes stops following a drifting run, and then
        # the forest flags everything. Rows are gated by the rolling baselines instead
        # (``healthy_gate_z``, in ``track``); a non-finite step has no row at all; the
        # layer shares learn winsorized (see ml_layers).
        return False

    def learn(self, event: StepEvent, state: MLState) -> None:
        if not state.healthy:
            return
        c = self.config
        state.pending.append(state.row)
        fitted = len(state.fitted)
        if state.forest is None:
            due = c.warmup_steps
        elif fitted < c.buffer_size:  # refit often while the buffer fills: early runs drift fast
            due = min(c.warmup_steps, c.refit_every)
        else:
            due = c.refit_every
        if len(state.pending) >= due:
            # A copy of the newest rows: a view would keep every row stacked here alive.
            stacked = np.vstack([state.fitted, state.pending.matrix()])
            state.fitted = stacked[-c.buffer_size :].copy()
            state.pending = Rows(_WIDTH)
            state.fits += 1
            self._build(state)

    def _build(self, state: MLState) -> None:
        """(Re)build the forest of fit ``state.fits`` from ``state.fitted``: deterministic."""
        c = self.config
        state.forest = compiled = fit_forest(
            state.fitted, c.n_estimators, c.max_samples, c.random_state + state.fits - 1
        )
        train = np.power(2.0, -compiled.path_sums(state.fitted) / compiled.norm)
        # An isolation forest cannot tell "far beyond the healthy tail" from "at it": scores
        # saturate at about the score of a row beyond every training extreme. So the
        # threshold sits a fraction of the way from a high training quantile to that ceiling.
        beyond = state.fitted.max(axis=0) + 1.0
        state.ceiling = compiled.score(float(compiled.path_sums(beyond[None, :])[0]))
        quantile = float(np.quantile(train, c.threshold_quantile))
        state.median = float(np.median(train))
        state.threshold = quantile + c.threshold_margin * max(state.ceiling - quantile, 0.0)

    # -- verdicts ------------------------------------------------------------
    def _plain(self, event: StepEvent, why: str) -> Verdict:
        bad = why == "non_finite"
        return validate_verdict({
            "run_id": event.run_id, "step": event.step, "epoch": event.epoch,
            "detector": self.name, "is_anomaly": bad,
            "type": AnomalyType.ML_OUTLIER if bad else AnomalyType.NONE,
            "confidence": self.config.nonfinite_confidence if bad else 0.0,
            "rules": ["non_finite"] if bad else [], "signals": {why: 1},
        })

    def _judged(self, event: StepEvent, state: MLState, score: float, loss_z: float) -> Verdict:
        threshold = state.threshold
        outlier = score > threshold
        if outlier:
            span = max(state.ceiling - threshold, 1e-9)
            confidence = 0.5 + 0.5 * min((score - threshold) / span, 1.0)
        else:
            span = max(threshold - state.median, 1e-9)
            confidence = min(max(0.5 * (score - state.median) / span, 0.0), 0.5)
        return validate_verdict({
            "run_id": event.run_id, "step": event.step, "epoch": event.epoch,
            "detector": self.name, "is_anomaly": outlier,
            "type": AnomalyType.ML_OUTLIER if outlier else AnomalyType.NONE,
            "confidence": confidence, "rules": ["isolation_forest"] if outlier else [],
            "signals": {"score": score, "threshold": threshold, "loss_z": loss_z},
        })

    def _blowup(self, event: StepEvent, state: MLState, found: LayerFinding,
                row: np.ndarray | str) -> Verdict:
        """A layer-local blow-up: which layer, its share before and now, and what the rest did."""
        signals: dict[str, Any] = {
            "layer": found.layer, "share": round(found.share, 4),
            "share_before": round(found.share_before, 4), "share_z": round(found.z, 2),
            "grad_ratio": round(found.grad_ratio, 3),
        }
        if not isinstance(row, str):  # the loss (and update size) beside it, in noise s.d.
            signals["loss_z"] = round(float(row[0]), 3)
            if event.update_norm is not None:
                signals["update_z"] = round(float(row[ML_FEATURES.index("update_z")]), 3)
        return validate_verdict({
            "run_id": event.run_id, "step": event.step, "epoch": event.epoch,
            "detector": self.name, "is_anomaly": True, "type": AnomalyType.LAYER_BLOWUP,
            "confidence": state.layers.confidence(found), "rules": ["layer_share"],
            "message": f"{found.layer} carries {found.share:.0%} of the squared gradient norm "
                       f"(baseline {found.share_before:.1%}); total norm x{found.grad_ratio:.2f}",
            "signals": signals, "loss": event.loss, "grad_norm": event.grad_norm,
        })

    # -- state ---------------------------------------------------------------
    # Snapshots: features and layers pickled (~0.5 kB); fitted rows and ``pending`` shared (a refit
    # replaces them; pending only grows till then). No forest: ~0.5 MB, rebuilt on need.
    _SHARED = ("fitted", "fits", "row", "healthy")

    def pack(self, state: MLState) -> tuple[bytes, Rows, int, tuple[Any, ...]]:
        head = pickle.dumps((state.features.state_dict(), state.layers.state_dict()), protocol=5)
        shared = tuple(getattr(state, name) for name in self._SHARED)
        return head, state.pending, len(state.pending), shared

    def unpack(self, packed: tuple[bytes, Rows, int, tuple[Any, ...]]) -> MLState:
        head, pending, count, shared = packed
        state = self.fresh()
        features, layers = pickle.loads(head)
        state.features.load_state_dict(features)
        state.layers.load_state_dict(layers)
        state.pending = pending.prefix(count)  # its own: the restored run appends to it
        for name, value in zip(self._SHARED, shared):
            setattr(state, name, value)
        live = self.state
        if state.fits and live.fits == state.fits and live.fitted is state.fitted:  # no refit since
            for name in ("forest", "threshold", "median", "ceiling"):
                setattr(state, name, getattr(live, name))
        elif state.fits:  # a rollback to before a refit: the same rows and seed give the same trees
            self._build(state)
        return state

    def dump(self, state: MLState) -> dict[str, Any]:
        return {
            "features": state.features.state_dict(),
            "fits": state.fits,
            "fitted": state.fitted.tolist(),
            "pending": state.pending.tolist(),
            "layers": state.layers.state_dict(),
        }

    def load(self, data: dict[str, Any]) -> MLState:
        state = self.fresh()
        state.features.load_state_dict(data["features"])
        state.layers.load_state_dict(data["layers"])
        state.fits = int(data["fits"])
        state.fitted = np.array(data["fitted"], dtype=np.float64).reshape(-1, _WIDTH)
        state.pending = Rows.from_rows(_WIDTH, data["pending"])
        if state.fits:
            self._build(state)
        return state
