"""The ``ml`` detector: a run's layer-share composition and an isolation forest over its healthy steps.

Two views, one verdict per step:

* **Layer shares** (:mod:`.layers`): when a step carries per-layer gradient
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
young run drifts fast), then every ``refit_every`` (3000: a fit and its
calibration cost ~12 ms, ~4 us a step, and the rolling features already
follow the run in between). "Healthy" is judged by the rolling baselines (every residual
within ``healthy_gate_z``), not by the forest: a buffer that only admits what
the forest likes stops following a drifting run, and then the forest flags
everything. A non-finite step never enters features or buffer and is an outlier
with ``nonfinite_confidence``.

Batching without look-ahead: features depend only on earlier events (never on
verdicts), so ``update_many`` computes the batch's rows first, in one pass over
a copy of the features and one vectorised clean-up, scores them with the current
forest in one walk, and rescores the rest of the batch only when a refit happens
inside it. That copy, once through the batch, becomes the run's features: each
step's features are computed once (a rollback snapshot due inside the batch
takes a copy on the way). ``update`` walks the forest for its one row: both give
identical verdicts. The forest is never pickled: ``state_dict`` keeps its rows,
the rows since and the fit count, and ``load_state_dict`` refits (same rows +
seed => same trees).

Memory, for a worker holding 10,000 runs (~88 kB a run on average, 101 kB at
most, from ~600 kB): rows are float32 (20 bytes; the forest sees float32
anyway), the compiled forest is ~36 kB (:mod:`.forest`), and of the healthy
rows since a fit only those the next fit can use are kept: it takes the newest
``buffer_size``, so once the buffer is full the first ``refit_every -
buffer_size`` rows of each round are counted, not stored. Rows are held once
however many rollback snapshots share them: a refit adopts the pending block
as its rows, and while the buffer fills the fits take windows of one block
(:class:`~.rows.Arena`). State is bounded:
at most ``2 * buffer_size`` rows of five floats (~90 kB of JSON at most),
``layers.max_layers`` share tracks. :meth:`MLDetector.release` drops a quiet
run's forest; the next step that needs it refits it from the same rows.
"""

from __future__ import annotations

import math
import pickle
from typing import Any, ClassVar, Sequence, cast

import numpy as np
from spikeguard.processors.detectors.base import Detector, validate_verdict
from spikeguard.processors.detectors.ml.batch import Batch as _Batch
from spikeguard.processors.detectors.ml.batch import clean
from spikeguard.processors.detectors.ml.config import MLConfig
from spikeguard.processors.detectors.ml.forest import CompiledForest, fit_forest
from spikeguard.processors.detectors.ml.layers import LayerFinding, LayerShares
from spikeguard.processors.detectors.ml.rows import Arena, Rows, as_json
from spikeguard.processors.features import ML_FEATURES, RollingFeatures
from spikeguard.schemas import AnomalyType, StepEvent, Verdict

__all__ = ["CompiledForest", "MLConfig", "MLDetector", "MLState"]

_WIDTH = len(ML_FEATURES)
_RESIDUALS = [ML_FEATURES.index(n) for n in ("loss_z", "loss_step", "grad_z", "update_z")]


class MLState:
    """One run's features, the forest's training rows, the forest, and the layer-share model."""

    __slots__ = (
        "features",
        "fitted",
        "arena",
        "pending",
        "since",
        "fits",
        "forest",
        "threshold",
        "median",
        "ceiling",
        "row",
        "healthy",
        "layers",
    )

    def __init__(self, features: RollingFeatures, layers: LayerShares) -> None:
        self.features = features
        self.layers = layers
        self.fitted = np.zeros(
            (0, _WIDTH), dtype=np.float32
        )  # rows the current forest was fitted on
        self.arena: Arena | None = (
            None  # the block ``fitted`` is a window of, while the buffer fills
        )
        self.since = 0  # healthy rows since that fit
        self.pending = Rows(_WIDTH)  # ... the newest of which the next fit will use
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
    # 2: the layer-share model; 3: "pending" holds only the rows the next fit uses, "since_fit"
    # counts them all (a version 2 state is read as well).
    state_version: ClassVar[int] = 3

    def __init__(self, config: MLConfig | None = None) -> None:
        self.config = config or MLConfig()
        super().__init__()

    def fresh(self) -> MLState:
        state = MLState(RollingFeatures(self.config.features), LayerShares(self.config.layers))
        state.pending = Rows(_WIDTH, self.config.buffer_size)  # it never holds more
        return state

    _batch: _Batch | None = None

    # -- judging -------------------------------------------------------------
    def _row(self, event: StepEvent, state: MLState) -> tuple[np.ndarray | str, RollingFeatures]:
        """The step's feature row (or why there is none), and the features after the step."""
        if not event.finite:
            return "non_finite", state.features  # never enters the features nor the buffer
        if self._rows_unread(state) and not event.top_grad_norms:
            return "forest_off", state.features
        f, after = state.features.peek_event(event)
        if f is None:
            return "warmup", after
        return clean(np.array(f.ml_vector(-self.config.downside_clip), dtype=np.float64)), after

    def _rows_unread(self, state: MLState) -> bool:
        """Whether this run's feature rows are never read: no forest, the features ready (so
        no "warmup" to tell), and no layer norms so far (a blow-up's verdict shows the loss's
        row beside it). Its verdicts are then "forest_off" whatever the rows hold, and its
        features stop where they are: computing them was most of this detector's per-step
        cost. A run whose layer norms start later resumes them from there."""
        return not self.config.forest and state.layers.n == 0 and state.features.ready

    def _current(self, event: StepEvent, state: MLState) -> np.ndarray | str:
        batch = self._batch
        if batch is None:
            return self.scored(event, state, self._row)[0]
        item = batch.items[batch.cursor]
        return item if isinstance(item, str) else batch.rows[item]

    def update_many(self, events: Sequence[StepEvent]) -> list[Verdict]:
        # The rows of a batch are known before any of it is judged (features depend on
        # earlier events only, never on verdicts), so the forest walks them in one pass.
        state = self.state
        if (
            len(events) < 2
            or any(event.epoch != self.epoch for event in events)
            or self._rows_unread(state)
        ):  # no rows to compute ahead
            return super().update_many(events)
        batch = self._batch = _Batch(
            state.features, events, -self.config.downside_clip, self.history
        )
        out = []
        try:
            for i, event in enumerate(events):
                batch.cursor = i
                out.append(self.update(event))
            state.features = batch.after
        except BaseException:
            # Stopped part-way: the run's features move past the steps it has tracked.
            state.features = batch.features_before(batch.tracked, state.features)
            raise
        finally:
            self._batch = None
        return out

    def score(self, event: StepEvent, state: MLState) -> Verdict:
        row = self._current(event, state)
        if isinstance(row, str) and row == "non_finite":
            return self._plain(event, row)
        shares = _shares(event)
        if shares is not None and event.grad_norm is not None:  # shares need a gradient norm
            found = state.layers.judge(event.grad_norm, shares)
            if found is not None and found.blowup:
                return self._blowup(event, state, found, row)
        if isinstance(row, str):
            return self._plain(event, row)
        if not self.config.forest:
            return self._plain(event, "forest_off")
        forest = self._forest(state)
        if forest is None:
            return self._plain(event, "warmup")
        batch = self._batch
        if batch is None:
            path_sum = float(forest.path_sums(row[None, :])[0])
        else:
            # An int: the step's row was found above, so its item is a row index, not a reason.
            path_sum = batch.path_sum(cast(int, batch.items[batch.cursor]), forest)
        return self._judged(event, state, forest.score(path_sum), float(row[0]))

    def track(self, event: StepEvent, state: MLState, verdict: Verdict) -> None:
        if self._batch is None:
            row, state.features = self.scored(event, state, self._row)
        else:  # the batch computed the row and the features ahead (adopted at its end)
            row = self._current(event, state)
            self._batch.tracked = self._batch.cursor + 1
        # A copy: a batch's row is a view that would keep the batch's whole matrix alive.
        state.row = None if isinstance(row, str) else row.copy()
        # Healthy (may train the forest): no residual beyond what the rolling baselines call
        # normal. Judged without the forest, so that the buffer keeps following a drifting run.
        state.healthy = (
            state.row is not None
            and bool(state.row[_RESIDUALS].max() <= self.config.healthy_gate_z)
            and verdict.type is not AnomalyType.LAYER_BLOWUP
        )
        shares = _shares(event)
        if shares is not None and event.grad_norm is not None:  # winsorized: see layers.py
            state.layers.learn(event.grad_norm, shares)

    def protects(self, verdict: Verdict) -> bool:
        # The forest's own verdict does not gate its training rows: a buffer that
        # admits only what the forest likes stops following a drifting run, and then
        # the forest flags everything. Rows are gated by the rolling baselines instead
        # (``healthy_gate_z``, in ``track``); a non-finite step has no row at all; the
        # layer shares learn winsorized (see layers.py).
        return False

    def _due(self, state: MLState) -> int:
        """Healthy rows after which the next fit happens (fixed between two fits)."""
        c = self.config
        if not state.fits:
            return c.warmup_steps
        if (
            len(state.fitted) < c.buffer_size
        ):  # refit often while the buffer fills: early runs drift fast
            return min(c.warmup_steps, c.refit_every)
        return c.refit_every

    def _skipped(self, state: MLState) -> int:
        """Rows since the fit that the next fit cannot use: it takes the newest ``buffer_size``."""
        return max(0, self._due(state) - self.config.buffer_size)

    def learn(self, event: StepEvent, state: MLState) -> None:
        row, state.row = state.row, None
        if row is None or not state.healthy or not self.config.forest:  # healthy rows only
            return
        state.since += 1
        due = self._due(state)
        if state.since > due - self.config.buffer_size:  # else the next fit cannot use it
            state.pending.append(row)
        if state.since >= due:
            size = self.config.buffer_size
            if len(state.pending) >= size:  # every row it takes is pending: share them
                state.fitted, state.arena = state.pending.freeze()[-size:], None
            else:  # the buffer fills: the previous fit's rows and these, one block for all
                state.arena, state.fitted = Arena.extend(
                    state.arena, state.fitted, state.pending.matrix(), size, size + due
                )
                state.pending.moved_to(state.fitted[len(state.fitted) - len(state.pending) :])
            state.pending = Rows(_WIDTH, size)
            state.since = 0
            state.fits += 1
            self._build(state)

    def release(self) -> bool:
        """Drop the run's live forest (a quiet run's biggest part); True if there was one.

        The rows it was fitted on stay, so the next step that needs it refits it: the same
        rows and seed grow the same trees, and every verdict is as if it had stayed.
        """
        state = self.state
        if state.forest is None:
            return False
        state.forest = None
        return True

    def _forest(self, state: MLState) -> CompiledForest | None:
        """The run's forest; refitted here if :meth:`release` dropped it."""
        if state.forest is None and state.fits:
            self._build(state)
        return state.forest

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
        beyond = state.fitted.max(axis=0).astype(np.float64) + 1.0
        state.ceiling = compiled.score(float(compiled.path_sums(beyond[None, :])[0]))
        quantile = float(np.quantile(train, c.threshold_quantile))
        state.median = float(np.median(train))
        state.threshold = quantile + c.threshold_margin * max(state.ceiling - quantile, 0.0)

    # -- verdicts ------------------------------------------------------------
    def _plain(self, event: StepEvent, why: str) -> Verdict:
        bad = why == "non_finite"
        return validate_verdict(
            {
                "run_id": event.run_id,
                "step": event.step,
                "epoch": event.epoch,
                "detector": self.name,
                "is_anomaly": bad,
                "type": AnomalyType.ML_OUTLIER if bad else AnomalyType.NONE,
                "confidence": self.config.nonfinite_confidence if bad else 0.0,
                "rules": ["non_finite"] if bad else [],
                "signals": {why: 1},
                "loss": event.loss,  # the step's values, as every verdict carries them
                "grad_norm": event.grad_norm,
            }
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
        return validate_verdict(
            {
                "run_id": event.run_id,
                "step": event.step,
                "epoch": event.epoch,
                "detector": self.name,
                "is_anomaly": outlier,
                "type": AnomalyType.ML_OUTLIER if outlier else AnomalyType.NONE,
                "confidence": confidence,
                "rules": ["isolation_forest"] if outlier else [],
                "signals": {"score": score, "threshold": threshold, "loss_z": loss_z},
            }
        )

    def _blowup(
        self, event: StepEvent, state: MLState, found: LayerFinding, row: np.ndarray | str
    ) -> Verdict:
        """A layer-local blow-up: which layer, its share before and now, and what the rest did."""
        signals: dict[str, Any] = {
            "layer": found.layer,
            "share": round(found.share, 4),
            "share_before": round(found.share_before, 4),
            "share_z": round(found.z, 2),
            "grad_ratio": round(found.grad_ratio, 3),
        }
        if not isinstance(row, str):  # the loss (and update size) beside it, in noise s.d.
            signals["loss_z"] = round(float(row[0]), 3)
            if event.update_norm is not None:
                signals["update_z"] = round(float(row[ML_FEATURES.index("update_z")]), 3)
        return validate_verdict(
            {
                "run_id": event.run_id,
                "step": event.step,
                "epoch": event.epoch,
                "detector": self.name,
                "is_anomaly": True,
                "type": AnomalyType.LAYER_BLOWUP,
                "confidence": state.layers.confidence(found),
                "rules": ["layer_share"],
                "message": f"{found.layer} carries {found.share:.0%} of the squared gradient norm "
                f"(baseline {found.share_before:.1%}); total norm x{found.grad_ratio:.2f}",
                "signals": signals,
                "loss": event.loss,
                "grad_norm": event.grad_norm,
            }
        )

    # -- state ---------------------------------------------------------------
    # Snapshots: features and layers pickled (~0.5 kB); fitted rows and ``pending`` shared (a refit
    # replaces them; pending only grows till then). No forest: ~40 kB, rebuilt on need. The
    # last step's row and health are not kept: learn() has used them before the next step.
    _SHARED = ("fitted", "arena", "fits", "since")

    def pack(self, state: MLState) -> tuple[bytes, Rows | None, int, tuple[Any, ...]]:
        features = state.features
        batch = self._batch
        if batch is not None and state is self.state:  # inside a batch: moved on at its end
            features = batch.features_before(batch.cursor, features)
        head = pickle.dumps((features.state_dict(), state.layers.state_dict()), protocol=5)
        shared = tuple(getattr(state, name) for name in self._SHARED)
        count = len(state.pending)
        return head, state.pending if count else None, count, shared

    def unpack(self, packed: tuple[bytes, Rows | None, int, tuple[Any, ...]]) -> MLState:
        head, pending, count, shared = packed
        state = self.fresh()
        features, layers = pickle.loads(head)
        state.features.load_state_dict(features)
        state.layers.load_state_dict(layers)
        if pending is not None:  # its own: the restored run appends to it
            state.pending = pending.prefix(count)
        for name, value in zip(self._SHARED, shared, strict=True):
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
            "fitted": as_json(state.fitted),
            "since_fit": state.since,
            "pending": state.pending.tolist(),
            "layers": state.layers.state_dict(),
        }

    def load(self, data: dict[str, Any]) -> MLState:
        state = self.fresh()
        state.features.load_state_dict(data["features"])
        state.layers.load_state_dict(data["layers"])
        state.fits = int(data["fits"])
        state.fitted = (
            np.array(data["fitted"], dtype=np.float64).reshape(-1, _WIDTH).astype(np.float32)
        )
        rows = data["pending"]
        state.since = int(data.get("since_fit", len(rows)))
        kept = max(0, state.since - self._skipped(state))  # a version 2 state kept them all
        state.pending = Rows.from_rows(
            _WIDTH, rows[len(rows) - kept :] if kept else [], self.config.buffer_size
        )
        if state.fits:
            self._build(state)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") == 2:  # the same keys, every row since the fit kept
            state = {**state, "version": self.state_version}
        super().load_state_dict(state)
