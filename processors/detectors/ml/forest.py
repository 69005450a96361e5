"""The ``ml`` detector's isolation forest: sklearn's trees, grown without its bookkeeping, walked by numpy.

sklearn's ``IsolationForest.score_samples`` loops over trees in Python (~6 ms per
call even for one row), so a fitted forest is flattened into arrays and walked
for all rows and trees at once (:class:`CompiledForest`).

``IsolationForest.fit`` spent ~60 % of its time outside the trees: cloning an
estimator per tree through ``get_params`` introspection, joblib dispatch,
``check_random_state`` round trips. :func:`fit_forest` grows the very same
``ExtraTreeRegressor`` trees from the very same seeds and row samples
(``IsolationForest`` with an integer ``random_state``, ``max_features=1.0``, no
bootstrap: the seeds come from ``RandomState(seed)``, each tree's sampling from
``RandomState(tree_seed)``, its splitter seed from the first draw of the same)
and nothing else: same rows + same seed => the same trees as sklearn's, which
``tests/processors/test_ml.py`` pins against ``IsolationForest`` itself.

A worker holds one live forest per run, 10,000 runs at a time, so the compiled
forest is sized to what it holds (~40 kB for 50 trees of 256 rows, against
~330 kB as padded float64/int32 tables): only split nodes have entries, leaves
of equal path length share one self-looping "sink" entry, thresholds are
float32 and node indices int16 when they fit. Scores are bit for bit those of
the padded tables (see :class:`CompiledForest`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

# scikit-learn is imported where a forest is grown, not here: it takes ~1.5 s of CPU
# to import, and the forest is off by default (a backtest or worker without it never pays).
if TYPE_CHECKING:
    from sklearn.ensemble import IsolationForest

_MAX_INT = np.iinfo(np.int32).max
_UNIT = 2.0**20  # leaf path lengths are whole multiples of 1 / _UNIT (see CompiledForest)


class _Fitted(NamedTuple):
    """What :class:`CompiledForest` reads of a fitted forest (an ``IsolationForest`` has both)."""

    estimators_: list
    max_samples_: int


def fit_forest(rows: np.ndarray, n_estimators: int, max_samples: int, seed: int) -> CompiledForest:
    """The compiled forest ``IsolationForest(n_estimators, max_samples, random_state=seed)`` fits."""
    from sklearn.utils.random import sample_without_replacement

    x = np.ascontiguousarray(
        rows, dtype=np.float32
    )  # what IsolationForest's validation makes of them
    n, width = x.shape
    y = np.asarray(
        np.random.RandomState(seed).uniform(size=n)
    )  # iforest's dummy target, drawn the same way
    draws = min(max_samples, n)
    depth = int(np.ceil(np.log2(max(draws, 2))))
    trees = []
    rng = np.random.RandomState(seed)
    for tree_seed in rng.randint(_MAX_INT, size=n_estimators):
        rng.seed(tree_seed)  # re-seeding one generator: what RandomState(tree_seed) gives
        splitter_seed = rng.randint(_MAX_INT)  # sklearn's _set_random_states
        rng.seed(tree_seed)  # _generate_bagging_indices starts again from the tree's seed
        sample_without_replacement(width, width, random_state=rng)  # the features: all, drawn
        picked = np.sort(sample_without_replacement(n, draws, random_state=rng))
        # sklearn weighs the drawn rows 1 and the others 0, and its splitter skips
        # zero-weight rows, keeping the order of the rest: the drawn rows alone, in row
        # order and unweighted, are the same tree at a fraction of the cost (sklearn
        # validated a 1024-row weight vector per tree: ~35 % of a fit).
        trees.append(_grow(x[picked], y[picked], depth, splitter_seed, rng))
    return CompiledForest(_Fitted(trees, draws))


class _Grown(NamedTuple):
    tree_: object  # sklearn's Tree, as a fitted estimator holds it


def _grow_public(
    x: np.ndarray, y: np.ndarray, depth: int, seed: int, rng: np.random.RandomState
) -> object:
    """One tree through ``ExtraTreeRegressor.fit``, its checks skipped (the rows are finite)."""
    import sklearn
    from sklearn.tree import ExtraTreeRegressor

    tree = ExtraTreeRegressor(max_features=1, splitter="random", max_depth=depth, random_state=seed)
    with sklearn.config_context(assume_finite=True, skip_parameter_validation=True):
        tree.fit(x, y, check_input=False)
    return tree


def _grow_direct(
    x: np.ndarray, y: np.ndarray, depth: int, seed: int, rng: np.random.RandomState
) -> object:
    """What ``ExtraTreeRegressor(max_features=1, splitter="random", max_depth=depth,
    random_state=seed).fit(x, y)`` builds, straight from sklearn's tree builder.

    ``fit`` spent most of a 256-row tree's time on its own bookkeeping (a new
    RandomState per call, parameter resolution). Private API, stable since sklearn 1.4 (when
    the splitter took ``monotonic_cst``); :func:`_grow` falls back to ``fit`` if it moves,
    and the tests pin the trees against ``IsolationForest`` either way.
    """
    from sklearn.tree._criterion import MSE
    from sklearn.tree._splitter import RandomSplitter
    from sklearn.tree._tree import DepthFirstTreeBuilder, Tree

    n, width = x.shape
    rng.seed(seed)  # what check_random_state(seed) would make: the splitter draws its seed from it
    # fit's resolved defaults: 1 feature per split, min_samples_leaf 1, min_weight_leaf 0,
    # min_samples_split 2, min_impurity_decrease 0, no monotonic constraints.
    splitter = RandomSplitter(MSE(1, n), 1, 1, 0.0, rng, None)
    tree = Tree(width, np.ones(1, dtype=np.intp), 1)
    DepthFirstTreeBuilder(splitter, 2, 1, 0.0, depth, 0.0).build(
        tree, x, np.ascontiguousarray(y.reshape(-1, 1), dtype=np.float64), None, None
    )
    return _Grown(tree)


def _grow(
    x: np.ndarray, y: np.ndarray, depth: int, seed: int, rng: np.random.RandomState
) -> object:
    global _grow_with
    try:
        return _grow_with(x, y, depth, seed, rng)
    except (ImportError, TypeError, AttributeError, ValueError):
        if _grow_with is _grow_public:
            raise
        _grow_with = _grow_public  # this sklearn's internals moved: the public way from now on
        return _grow_with(x, y, depth, seed, rng)


_grow_with = _grow_direct


def _path_length(n: np.ndarray) -> np.ndarray:
    """Average unsuccessful-search path length in a BST of n points (Liu et al. 2008)."""
    n = np.asarray(n, dtype=np.float64)
    out = np.zeros_like(n)
    big = n > 2
    out[n == 2] = 1.0
    out[big] = 2.0 * (np.log(n[big] - 1.0) + np.euler_gamma) - 2.0 * (n[big] - 1.0) / n[big]
    return out


def _round_down_f32(values: np.ndarray) -> np.ndarray:
    """The largest float32 at or below each value: for a float32 x, ``x <= t`` iff ``x <= that``."""
    out = values.astype(np.float32)
    above = out.astype(np.float64) > values
    out[above] = np.nextafter(out[above], np.float32(-np.inf))
    return out


class CompiledForest:
    """A fitted IsolationForest's trees as flat arrays, walked for all rows and trees at once.

    sklearn's ``score_samples`` loops over trees in Python (~6 ms per call even for
    one row); this walks every tree level by level in numpy instead.

    Layout (one entry per split node of every tree, then one per distinct leaf
    path length): ``feature`` (uint8), ``threshold`` (float32), ``left``/``right``
    (entry indices). A leaf is a *sink* entry: threshold +inf, both children
    itself, so a walk of ``depth`` levels ends every lane in a sink, and
    ``leaf_value[entry - splits]`` is its path length in units of 2**-20.

    Exactness: sklearn compares float32 features with float64 thresholds; the
    largest float32 at or below a threshold splits every float32 the same way.
    Leaf path lengths are rounded to multiples of 2**-20 and summed as integers,
    so sums are exact and identical whatever the batch size or summation order.
    """

    def __init__(self, forest: IsolationForest | _Fitted) -> None:
        trees = [est.tree_ for est in forest.estimators_]
        counts = np.array([t.node_count for t in trees])
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        # All trees' nodes side by side (node ids offset by their tree's start).
        kids_l = np.concatenate([t.children_left[: t.node_count] for t in trees]).astype(np.intp)
        kids_r = np.concatenate([t.children_right[: t.node_count] for t in trees]).astype(np.intp)
        split = kids_l >= 0
        offsets = np.repeat(starts, counts)
        kids_l = np.where(split, kids_l + offsets, -1)
        kids_r = np.where(split, kids_r + offsets, -1)
        depth = np.zeros(len(split), dtype=np.intp)
        frontier, level = starts, 0
        while frontier.size:  # breadth-first over every tree at once: one numpy step per level
            frontier = np.concatenate((kids_l[frontier], kids_r[frontier]))
            frontier, level = frontier[frontier >= 0], level + 1
            depth[frontier] = level
        samples = np.concatenate([t.n_node_samples[: t.node_count] for t in trees])
        leaf = (np.round((depth[~split] + _path_length(samples[~split])) * _UNIT)).astype(np.int64)
        self.leaf_value, sink = np.unique(leaf, return_inverse=True)
        splits = int(split.sum())
        entries = splits + len(self.leaf_value)
        index = np.int16 if entries <= np.iinfo(np.int16).max else np.int32
        entry = np.empty(len(split), dtype=np.intp)  # node -> its entry
        entry[split] = np.arange(splits)
        entry[~split] = splits + sink.ravel()
        sinks = np.arange(splits, entries)
        self.left = np.concatenate((entry[kids_l[split]], sinks)).astype(index)
        self.right = np.concatenate((entry[kids_r[split]], sinks)).astype(index)
        features = np.concatenate([t.feature[: t.node_count] for t in trees])[split]
        self.feature = np.concatenate((features, np.zeros(len(sinks)))).astype(np.uint8)
        thresholds = np.concatenate([t.threshold[: t.node_count] for t in trees])[split]
        self.threshold = np.concatenate(
            (_round_down_f32(thresholds), np.full(len(sinks), np.inf, dtype=np.float32))
        )
        self.roots = entry[starts].astype(index)
        self.splits = splits
        self.depth = int(depth.max())
        self.norm = len(trees) * float(_path_length(np.array([forest.max_samples_]))[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays: what a run's live forest costs."""
        return sum(
            a.nbytes
            for a in (
                self.left,
                self.right,
                self.feature,
                self.threshold,
                self.leaf_value,
                self.roots,
            )
        )

    def path_sums(self, rows: np.ndarray) -> np.ndarray:
        """Sum over trees of each row's path length (exact; smaller = more isolated)."""
        x = np.asarray(rows, dtype=np.float32)  # sklearn compares in float32
        n = x.shape[0]
        flat_x = x.T.ravel()  # feature f of row j at f * n + j
        cols = np.arange(n)
        node = np.repeat(self.roots[:, None], n, axis=1)
        feature, threshold, left, right = self.feature, self.threshold, self.left, self.right
        for _ in range(self.depth):
            value = flat_x[feature[node].astype(np.intp) * n + cols]
            node = np.where(value <= threshold[node], left[node], right[node])
        return self.leaf_value[node - self.splits].sum(axis=0) / _UNIT

    def score(self, path_sum: float) -> float:
        """The anomaly score in (0, 1] (sklearn's ``-score_samples``); 0.5 is ordinary."""
        return math.pow(2.0, -path_sum / self.norm) if self.norm > 0 else 1.0
