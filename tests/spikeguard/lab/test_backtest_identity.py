"""The backtest identity: the decisions of every simulated scenario, pinned by their sha256.

A change that makes the pipeline cheaper (batched arithmetic, fewer objects,
lazy imports) must not change a single decision: any difference here is a
change of behaviour, to be explained and re-pinned on purpose, never by habit.
"""

from __future__ import annotations

import hashlib

import pytest

from spikeguard.lab.backtest import backtest_events
from spikeguard.lab.simulate import SCENARIOS, generate

STEPS = 3000

#: scenario-seed: (decisions, sha256 of their JSON lines), the default settings
PINNED = {
    "data_shift-0": (3000, "8c73480766cddaa3e6d6f31555905b01d5b148edd050e303d8342ad51a9a7894"),
    "data_shift-1": (3000, "ac4b3ec322c938e6f5064e1bd11eddce340bb195978355ed9b25095fa49ba949"),
    "divergence-0": (3000, "52226735d16b3a230b89129881769ec11b2b81d893a095902efed3a7dafa4a6b"),
    "divergence-1": (3000, "c060344942cc04389bb27412012f329719b56e8fd62c6f7484fdf5838a374ba5"),
    "eval_bumps-0": (3000, "785802a515172baa02263ac8633c386fd43f7ace2f3626eee928611bcbae16a5"),
    "eval_bumps-1": (3000, "b01b052240f36f7c7b2ae3621f892342b8c74b3bc9e208eaeabe30c636fa7b6c"),
    "grad_explosion-0": (3000, "fb3fcab3d3a931ec627b63492cb1fa771774b50327c6d00d9ac17176c6b81a37"),
    "grad_explosion-1": (3000, "8180c9aaadc2e32e62154d2a71cbe19a9850e3bf31787f098c25048ff8f92507"),
    "gradual_spike-0": (3000, "fa6bae66dc0d979da0c364884b36742156eed9e0e7178a81a174cd32678e410d"),
    "gradual_spike-1": (3000, "84792ca2e5d9efa7aaaf1d3ddcc8275472711116681992f6590677e0ab21e76f"),
    "heavy_tailed-0": (3000, "c188c3d1ef81eb0dcd2e649be80ffac0cffb62f313d8b5af40fdcffc30ad5459"),
    "heavy_tailed-1": (3000, "efc37cbe7b85e5b739f3624f21f7703d8965461e0661a29dfc73495d41c78f64"),
    "non_finite-0": (3000, "d0315526f6e5f8ed5a608fbf8167a65d6bb416d5ea4ede29fb9c56ddc7afde8c"),
    "non_finite-1": (3000, "8a14d4cf9e706ba44fa953d678969c7a0c3b4c0ab5b002b27332842387300def"),
    "oscillation-0": (3000, "604811084109d155189312285cfd7fc5ac21a0e66da85ecfdfb20f995c32de03"),
    "oscillation-1": (3000, "388d81d9fe3a9bda1610edbbf04a60d509699869efa6b847853f68a398ea4fae"),
    "stable-0": (3000, "87a312ab198577508ef699c4f80aa53f9e3043577baace4157b974f7a0ec3a54"),
    "stable-1": (3000, "ca17c6def372384ff82982f80dc6ab171f0c73ab8c9fb43eec4702260dbf6397"),
    "sudden_spike-0": (3000, "dbf027aa64c9084d7451ac51cd4eb0574cd87714f0ff24c7c96d1e3cc45a6cde"),
    "sudden_spike-1": (3000, "518228460055b3696bc78400f3373eeaa513a000b82bbac29e290bf86a622f66"),
}


def test_every_scenario_is_pinned() -> None:
    assert {key.rsplit("-", 1)[0] for key in PINNED} == set(SCENARIOS)


@pytest.mark.parametrize("key", sorted(PINNED))
@pytest.mark.heavy
def test_decisions_are_those_pinned(key: str) -> None:
    scenario, seed = key.rsplit("-", 1)
    decisions = backtest_events(generate(scenario, STEPS, int(seed)).events)
    text = "\n".join(decision.model_dump_json() for decision in decisions)
    assert (len(decisions), hashlib.sha256(text.encode()).hexdigest()) == PINNED[key]
