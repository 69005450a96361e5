"""The ML detector's compiled forest: sklearn's own trees walked exactly, in a fraction of the memory."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.ensemble import IsolationForest

from spikeguard.processors.detectors.ml.forest import CompiledForest, _path_length, fit_forest

WIDTH = 5


def reference_path_sums(forest: IsolationForest, rows: np.ndarray) -> np.ndarray:
    """Each row's summed path length read off sklearn's trees themselves (``apply`` + depths),
    each leaf's length rounded to 2**-20 as the compiled forest promises."""
    x = np.asarray(rows, dtype=np.float32)
    total = np.zeros(len(x))
    for est in forest.estimators_:
        t = est.tree_
        depth = np.asarray(est.decision_path(x).sum(axis=1)).ravel() - 1
        leaves = est.apply(x)
        value = depth + _path_length(t.n_node_samples[leaves])
        total += np.round(value * 2.0**20) / 2.0**20
    return total


def heavy_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """Rows like the detector's: 4 decimals, clamped at -1, heavy upper tail, a few at the bound."""
    rows = np.maximum(np.round(3.0 * rng.standard_t(3, size=(n, WIDTH)), 4), -1.0)
    rows[rng.integers(0, n, 3)] = 1e6
    return rows


@pytest.mark.parametrize(
    ("n", "trees", "samples", "seed"), [(1024, 50, 256, 0), (300, 30, 128, 4), (40, 10, 256, 2)]
)
def test_compact_walk_is_exactly_sklearns_trees(
    n: int, trees: int, samples: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    rows = heavy_rows(rng, n)
    forest = IsolationForest(
        n_estimators=trees, max_samples=min(samples, n), random_state=seed
    ).fit(rows)
    compiled = CompiledForest(forest)
    # Probes on every split: the thresholds themselves (float64, between two float32s) and
    # the float32s on either side of them, where a float32 threshold could go wrong.
    cuts = np.concatenate(
        [e.tree_.threshold[e.tree_.children_left >= 0] for e in forest.estimators_]
    )
    f32 = cuts.astype(np.float32)
    edges = np.concatenate(
        [f32, np.nextafter(f32, np.float32(np.inf)), np.nextafter(f32, np.float32(-np.inf))]
    )
    probe = np.vstack(
        [
            rows,
            heavy_rows(rng, 500),
            np.resize(edges, (len(edges) // WIDTH, WIDTH)),
            rng.permuted(np.resize(edges, (len(edges) // WIDTH, WIDTH)), axis=0),
        ]
    )
    assert np.array_equal(compiled.path_sums(probe), reference_path_sums(forest, probe))
    np.testing.assert_allclose(
        [compiled.score(s) for s in compiled.path_sums(probe)],
        -forest.score_samples(probe),
        atol=1e-6,
    )


def test_fit_forest_is_compact() -> None:
    """50 trees of 256 rows: ~40 kB live (it was ~330 kB as padded float64/int32 tables)."""
    rng = np.random.default_rng(0)
    compiled = fit_forest(np.round(rng.normal(size=(1024, WIDTH)), 4), 50, 256, 0)
    assert compiled.nbytes < 50_000
    assert compiled.left.dtype == np.int16 and compiled.threshold.dtype == np.float32
    assert len(compiled.leaf_value) < 400  # leaves of equal path length share one entry


def test_wide_forests_switch_to_int32_indices() -> None:
    rng = np.random.default_rng(1)
    rows = np.round(rng.normal(size=(4096, WIDTH)), 4)
    compiled = fit_forest(rows, 200, 1024, 3)
    assert compiled.left.dtype == np.int32  # > 32767 entries
    forest = IsolationForest(n_estimators=200, max_samples=1024, random_state=3).fit(rows)
    probe = rows[:300]
    assert np.array_equal(compiled.path_sums(probe), reference_path_sums(forest, probe))


def test_trees_from_sklearns_builder_are_those_fit_grows_and_fit_is_the_fallback(
    monkeypatch,
) -> None:
    from spikeguard.processors.detectors.ml import forest

    rows = heavy_rows(np.random.default_rng(5), 700)
    direct = fit_forest(rows, 20, 256, 9)

    def moved(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise TypeError("__cinit__() takes exactly 7 positional arguments")  # a future sklearn

    monkeypatch.setattr(forest, "_grow_with", moved)
    monkeypatch.setattr(forest, "_grow_public", forest._grow_public)
    fallback = fit_forest(rows, 20, 256, 9)
    assert forest._grow_with is forest._grow_public
    for name in ("left", "right", "feature", "threshold", "leaf_value", "roots"):
        assert np.array_equal(getattr(direct, name), getattr(fallback, name)), name
