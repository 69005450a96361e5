"""The ``ml`` detector: an isolation forest over a run's own healthy behaviour.

Per run, it learns what ordinary steps look like in a scale-free feature space
(loss residual, step change, volatility ratio, grad-norm residual,
update-size residual; see :mod:`spikeguard.processors.features`), clamped
below so that a falling loss or a calm stretch is never "unusual", and calls a
step an ``ML_OUTLIER`` when its anomaly score passes a threshold calibrated at
each fit. One voice among several: never critical.

Calibration: a forest's scores saturate — a row beyond every training extreme
scores about the same as the most extreme training rows — so the threshold is
placed ``threshold_margin`` of the way from a high quantile of the training
scores to that ceiling (the score of a row just beyond all of them).
Confidence is 0.5 at the threshold and 1 at the ceiling.

Lifecycle: warm-up (``is_anomaly=False``, ``confidence=0``,
``signals={"warmup": 1}``) until ``warmup_steps`` healthy rows are buffered;
fit; refit every ``warmup_steps`` healthy rows until the buffer is full (a
young run drifts fast), then every ``refit_every``, on the newest
``buffer_size`` healthy rows. "Healthy" is judged by the rolling baselines
(every residual within ``healthy_gate_z``), not by the forest: a buffer that
only admits what the forest likes stops following a drifting run, and then the
forest flags everything. A non-finite step never enters features or buffer and
is an outlier with ``nonfinite_confidence``.

Batching without look-ahead: features depend only on earlier events (never on
verdicts), so ``update_many`` computes the batch's rows first (on a copy of the
features), scores them with the current forest in one vectorised pass, and
rescores the rest of the batch only when a refit happens inside it. ``update``
walks the forest for its one row: both give identical verdicts. The forest is never pickled: ``state_dict``
keeps the rows it was fitted on, the rows since, and the fit count, and
``load_state_dict`` refits (same rows + same seed => same trees => same scores).
State is bounded: at most ``buffer_size + max(warmup_steps, refit_every)`` rows
of five rounded floats (at most ~160 kB of JSON with the defaults; ~40 bytes a row).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Sequence

import numpy as np
import sklearn
from pydantic import BaseModel, ConfigDict, Field
from sklearn.ensemble import IsolationForest

from spikeguard.processors.detectors.base import Detector
from spikeguard.processors.features import ML_FEATURES, FeatureConfig, RollingFeatures
from spikeguard.schemas import AnomalyType, StepEvent, Verdict

_BOUND = 1e6  # keeps extreme-but-finite features finite in float32
_RESIDUALS = [ML_FEATURES.index(n) for n in ("loss_z", "loss_step", "grad_z", "update_z")]


class MLConfig(BaseModel):
    """Defaults: 50 trees x 256 rows and a refit every 3000 healthy steps keep it above
    20k steps/s; the threshold flags ~0.5 % of the (heavy-tailed) real NanoGPT steps,
    nearly all of them real upward jumps, and ~0.1 % of simulated healthy steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    features: FeatureConfig = Field(default_factory=FeatureConfig, description="rolling features")
    warmup_steps: int = Field(
        200, ge=16, description="healthy rows before the first fit, and between early refits"
    )
    buffer_size: int = Field(1024, ge=16, description="newest healthy rows the forest is fitted on")
    refit_every: int = Field(
        3000, ge=16, description="healthy rows between refits, once the buffer is full"
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


def _path_length(n: np.ndarray) -> np.ndarray:
    """Average unsuccessful-search path length in a BST of n points (Liu et al. 2008)."""
    n = np.asarray(n, dtype=np.float64)
    out = np.zeros_like(n)
    big = n > 2
    out[n == 2] = 1.0
    out[big] = 2.0 * (np.log(n[big] - 1.0) + np.euler_gamma) - 2.0 * (n[big] - 1.0) / n[big]
    return out


class CompiledForest:
    """A fitted IsolationForest's trees as flat arrays, walked for all rows and trees at once.

    sklearn's ``score_samples`` loops over trees in Python (~6 ms per call even for
    one row); this walks every tree level by level in numpy instead. Leaf path
    lengths are rounded to multiples of 2**-20 so that their sums are exact, and
    hence identical whatever the batch size or summation order.
    """

    def __init__(self, forest: IsolationForest) -> None:
        trees = [est.tree_ for est in forest.estimators_]
        width = max(t.node_count for t in trees)
        t_count = len(trees)
        left = np.tile(np.arange(width), (t_count, 1))
        right, feature = left.copy(), np.zeros((t_count, width), dtype=np.intp)
        threshold = np.full((t_count, width), np.inf)
        leaf_value = np.zeros((t_count, width))
        self.depth = 0
        for i, t in enumerate(trees):
            k = t.node_count
            depth = np.zeros(k, dtype=np.intp)
            frontier, level = np.zeros(1, dtype=np.intp), 0
            while frontier.size:  # breadth-first: one numpy step per level
                kids = np.concatenate((t.children_left[frontier], t.children_right[frontier]))
                frontier, level = kids[kids >= 0], level + 1
                depth[frontier] = level
            inner = t.children_left[:k] >= 0
            left[i, :k] = np.where(inner, t.children_left[:k], np.arange(k))
            right[i, :k] = np.where(inner, t.children_right[:k], np.arange(k))
            feature[i, :k] = np.where(inner, t.feature[:k], 0)
            threshold[i, :k] = np.where(inner, t.threshold[:k], np.inf)
            leaf_value[i, :k] = depth + _path_length(t.n_node_samples[:k])
            self.depth = max(self.depth, int(depth.max()))
        offset = (np.arange(t_count) * width)[:, None]
        self.left, self.right = (left + offset).ravel(), (right + offset).ravel()
        self.feature, self.threshold = feature.ravel(), threshold.ravel()
        self.leaf_value = (np.round(leaf_value * 2.0**20) / 2.0**20).ravel()
        self.roots = offset
        self.norm = t_count * float(_path_length(np.array([forest.max_samples_]))[0])

    def path_sums(self, rows: np.ndarray) -> np.ndarray:
        """Sum over trees of each row's path length (exact; smaller = more isolated)."""
        x = np.asarray(rows, dtype=np.float32).astype(np.float64)  # sklearn compares in float32
        n = x.shape[0]
        flat_x = x.T.ravel()  # feature f of row j at f * n + j
        cols = np.arange(n)
        node = np.repeat(self.roots, n, axis=1)
        for _ in range(self.depth):
            value = flat_x[self.feature[node] * n + cols]
            node = np.where(value <= self.threshold[node], self.left[node], self.right[node])
        return self.leaf_value[node].sum(axis=0)

    def score(self, path_sum: float) -> float:
        """The anomaly score in (0, 1] (sklearn's ``-score_samples``); 0.5 is ordinary."""
        return math.pow(2.0, -path_sum / self.norm) if self.norm > 0 else 1.0


class _Batch:
    """The rows of a batch's steps, computed ahead, and their path sums in one forest walk.

    Exact: leaf path lengths are rounded so that sums do not depend on the batch,
    and the rows come from the very code ``score`` runs, on a copy of the features.
    """

    def __init__(self, detector: MLDetector, events: Sequence[StepEvent]) -> None:
        ahead = MLState(detector.state.features)
        rows: list[np.ndarray] = []
        self.index: dict[int, int] = {}  # id(event) -> its row
        for event in events:
            row, ahead.features = detector._row(event, ahead)
            if not isinstance(row, str):
                self.index[id(event)] = len(rows)
                rows.append(row)
        self.rows = np.array(rows).reshape(-1, len(ML_FEATURES))
        self._forest: CompiledForest | None = None
        self._first = 0
        self._sums: list[float] = []

    def path_sum(self, i: int, forest: CompiledForest) -> float:
        if forest is not self._forest or i < self._first:  # first use, or a refit since
            self._forest, self._first = forest, i
            self._sums = forest.path_sums(self.rows[i:]).tolist()
        return self._sums[i - self._first]


class MLState:
    """One run's features, the forest's training rows and the forest fitted on them."""

    __slots__ = ("features", "fitted", "pending", "fits", "forest", "threshold", "median",
                 "ceiling", "row", "healthy")

    def __init__(self, features: RollingFeatures) -> None:
        self.features = features
        self.fitted = np.zeros((0, len(ML_FEATURES)))  # rows the current forest was fitted on
        self.pending: list[np.ndarray] = []  # healthy rows since that fit
        self.fits = 0
        self.forest: CompiledForest | None = None
        self.threshold = self.median = self.ceiling = math.nan  # in score units
        self.row: np.ndarray | None = None  # the last step's row (what learn() needs)
        self.healthy = False  # ... and whether it may train the forest


class MLDetector(Detector[MLState]):
    name: ClassVar[str] = "ml"

    def __init__(self, config: MLConfig | None = None) -> None:
        self.config = config or MLConfig()
        super().__init__()

    def fresh(self) -> MLState:
        return MLState(RollingFeatures(self.config.features))

    _batch: _Batch | None = None

    # -- judging -------------------------------------------------------------
    def _row(self, event: StepEvent, state: MLState) -> tuple[np.ndarray | str, RollingFeatures]:
        """The step's feature row (or why there is none), and the features after the step."""
        if not event.finite:
            return "non_finite", state.features  # never enters the features nor the buffer
        f, after = state.features.peek_event(event)
        if f is None:
            return "warmup", after
        # Rounded so the buffer is exact and short in JSON; far below the noise.
        raw = np.array(f.ml_vector(-self.config.downside_clip), dtype=np.float64)
        raw = np.nan_to_num(raw, nan=0.0, posinf=_BOUND, neginf=-_BOUND).clip(-_BOUND, _BOUND)
        return np.round(raw, 4), after

    def update_many(self, events: Sequence[StepEvent]) -> list[Verdict]:
        # The rows of a batch are known before any of it is judged (features depend on
        # earlier events only, never on verdicts), so the forest walks them in one pass.
        if len(events) > 1 and all(event.epoch == self.epoch for event in events):
            self._batch = _Batch(self, events)
        try:
            return super().update_many(events)
        finally:
            self._batch = None

    def score(self, event: StepEvent, state: MLState) -> Verdict:
        row, _ = self.scored(event, state, self._row)
        if isinstance(row, str):
            return self._plain(event, row)
        forest = state.forest
        if forest is None:
            return self._plain(event, "warmup")
        batch = self._batch
        if batch is None or id(event) not in batch.index:
            path_sum = float(forest.path_sums(row[None, :])[0])
        else:
            path_sum = batch.path_sum(batch.index[id(event)], forest)
        return self._judged(event, state, forest.score(path_sum), float(row[0]))

    def track(self, event: StepEvent, state: MLState, verdict: Verdict) -> None:
        row, state.features = self.scored(event, state, self._row)
        state.row = None if isinstance(row, str) else row
        # Healthy (may train the forest): no residual beyond what the rolling baselines call
        # normal. Judged without the forest, so that the buffer keeps following a drifting run.
        state.healthy = state.row is not None and bool(
            row[_RESIDUALS].max() <= self.config.healthy_gate_z
        )

    def protects(self, verdict: Verdict) -> bool:
        # The forest's own verdict does not gate its training rows: a buffer that
        # admits only what the forest likes stops following a drifting run, and then
        # the forest flags everything. Rows are gated by the rolling baselines instead
        # (``healthy_gate_z``, in ``track``); a non-finite step has no row at all.
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
            state.fitted = np.vstack([state.fitted, *state.pending])[-c.buffer_size :]
            state.pending = []
            state.fits += 1
            self._build(state)

    def _build(self, state: MLState) -> None:
        """(Re)build the forest of fit ``state.fits`` from ``state.fitted``: deterministic."""
        c = self.config
        # The rows are finite and the parameters validated by MLConfig: skip sklearn's re-checks.
        with sklearn.config_context(assume_finite=True, skip_parameter_validation=True):
            forest = IsolationForest(
                n_estimators=c.n_estimators,
                max_samples=min(c.max_samples, len(state.fitted)),
                random_state=c.random_state + state.fits - 1,
            ).fit(state.fitted)
        state.forest = compiled = CompiledForest(forest)
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
        return Verdict(
            run_id=event.run_id,
            step=event.step,
            epoch=event.epoch,
            detector=self.name,
            is_anomaly=bad,
            type=AnomalyType.ML_OUTLIER if bad else AnomalyType.NONE,
            confidence=self.config.nonfinite_confidence if bad else 0.0,
            rules=["non_finite"] if bad else [],
            signals={why: 1},
        )

    def _judged(self, event: StepEvent, state: MLState, score: float, loss_z: float) -> Verdict:
        threshold = state.threshold
        outlier = score > threshold
        if outlier:
            span = max(state.ceiling - threshold, 1e-9)
            confidence = 0.5 + 0.5 * min((score - threshold) / span, 1.0)
        else:
            span = max(threshold - state.median, 1e-9)
            confidence = min(max(0.5 * (score - state.median) / span, 0.0), 0.5)
        return Verdict(
            run_id=event.run_id,
            step=event.step,
            epoch=event.epoch,
            detector=self.name,
            is_anomaly=outlier,
            type=AnomalyType.ML_OUTLIER if outlier else AnomalyType.NONE,
            confidence=confidence,
            rules=["isolation_forest"] if outlier else [],
            signals={"score": score, "threshold": threshold, "loss_z": loss_z},
        )

    # -- state ---------------------------------------------------------------
    def copy(self, state: MLState) -> MLState:
        # The fitted rows and the forest are replaced at a refit, never changed in
        # place: a snapshot shares them, and costs the features and a list.
        twin = MLState.__new__(MLState)
        for name in MLState.__slots__:
            setattr(twin, name, getattr(state, name))
        twin.features = state.features.copy()
        twin.pending = list(state.pending)
        return twin

    def dump(self, state: MLState) -> dict[str, Any]:
        return {
            "features": state.features.state_dict(),
            "fits": state.fits,
            "fitted": state.fitted.tolist(),
            "pending": [row.tolist() for row in state.pending],
        }

    def load(self, data: dict[str, Any]) -> MLState:
        state = self.fresh()
        state.features.load_state_dict(data["features"])
        state.fits = int(data["fits"])
        state.fitted = np.array(data["fitted"], dtype=np.float64).reshape(-1, len(ML_FEATURES))
        state.pending = [np.array(row, dtype=np.float64) for row in data["pending"]]
        if state.fits:
            self._build(state)
        return state
