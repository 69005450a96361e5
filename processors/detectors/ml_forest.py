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
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import sklearn
from sklearn.ensemble import IsolationForest
from sklearn.tree import ExtraTreeRegressor
from sklearn.utils.random import sample_without_replacement

_MAX_INT = np.iinfo(np.int32).max


class _Fitted(NamedTuple):
    """What :class:`CompiledForest` reads of a fitted forest (an ``IsolationForest`` has both)."""

    estimators_: list
    max_samples_: int


def fit_forest(rows: np.ndarray, n_estimators: int, max_samples: int, seed: int) -> CompiledForest:
    """The compiled forest ``IsolationForest(n_estimators, max_samples, random_state=seed)`` fits."""
    x = np.ascontiguousarray(rows, dtype=np.float32)  # what IsolationForest's validation makes of them
    n, width = x.shape
    y = np.random.RandomState(seed).uniform(size=n)  # iforest's dummy target, drawn the same way
    draws = min(max_samples, n)
    depth = int(np.ceil(np.log2(max(draws, 2))))
    trees = []
    # The rows are finite and the parameters validated by MLConfig: skip sklearn's re-checks.
    rng = np.random.RandomState(seed)
    with sklearn.config_context(assume_finite=True, skip_parameter_validation=True):
        for tree_seed in rng.randint(_MAX_INT, size=n_estimators):
            rng.seed(tree_seed)  # re-seeding one generator: what RandomState(tree_seed) gives
            splitter_seed = rng.randint(_MAX_INT)  # sklearn's _set_random_states
            rng.seed(tree_seed)  # _generate_bagging_indices starts again from the tree's seed
            sample_without_replacement(width, width, random_state=rng)  # the features: all, drawn
            picked = sample_without_replacement(n, draws, random_state=rng)
            weight = np.bincount(picked, minlength=n).astype(np.float64)  # the rows drawn, as weights
            tree = ExtraTreeRegressor(max_features=1, splitter="random", max_depth=depth,
                                      random_state=splitter_seed)
            tree.fit(x, y, sample_weight=weight, check_input=False)
            trees.append(tree)
    return CompiledForest(_Fitted(trees, draws))


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

    def __init__(self, forest: IsolationForest | _Fitted) -> None:
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
        # Node and feature indices as int32 (a forest has far fewer than 2**31 nodes): the
        # same walk, 150 of the ~500 kB a run's forest held as int64.
        self.left = (left + offset).ravel().astype(np.int32)
        self.right = (right + offset).ravel().astype(np.int32)
        self.feature, self.threshold = feature.ravel().astype(np.int32), threshold.ravel()
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


