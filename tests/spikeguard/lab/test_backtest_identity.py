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
    "stable-0": (3000, "4c59fd09fef804aa57812212465d0925464f6213747936875911c996da69160c"),
    "stable-1": (3000, "b56f24a9b9ebbdba565a321ecb88d270772b506d88fb6673d0fe2f938e5e9000"),
    "heavy_tailed-0": (3000, "83c6a68ac8acc6fa2c271e5e73362352cda562b8bbab302f1041b253022f715b"),
    "heavy_tailed-1": (3000, "78217dd20b988530930b3222b238019724b1a7f90e9805681e62926e5c9adb1e"),
    "data_shift-0": (3000, "19557570bf391a8aab293ee83e9e0bfe98cc2befdd576b8fd2343ec30934adc3"),
    "data_shift-1": (3000, "caf769f82ad55647210af95d5964e1b99ac3fe822c17fc0170739e39e87c03ae"),
    "eval_bumps-0": (3000, "96365f359e54c394279d4a2c7726a714ca486e98dfb9aed9ea7d2e7fc893ec52"),
    "eval_bumps-1": (3000, "946c81e4865a09fdb02a7b62dfd75fb1a5cff464d98b7d471a7427012518e209"),
    "sudden_spike-0": (3000, "e540a8f3e43c9c52f270abb0313889b9266a28841777f79f26aa231797e40e84"),
    "sudden_spike-1": (3000, "59a12ae02d56cd08d5f74c01548e3f903c204a2203b708891046038f0ff0eaf9"),
    "gradual_spike-0": (3000, "09f51090eb8368cefb498b295eb8fde123f3e51d0a9fa627cdab7d86b40a9354"),
    "gradual_spike-1": (3000, "d8e3779d76e883376deb99180b82a9806dad08768908fb842f4438cdd486fd60"),
    "divergence-0": (3000, "9fecf88c0e52faffe2610b49f4aa1c74f94d537c1ceef11d2ad4d5cf33bf54b0"),
    "divergence-1": (3000, "3d8721f22e5d52a68c06b5bb5099d6268e1ddb9c62f2f52090943cfc2e6d1b01"),
    "oscillation-0": (3000, "1523df15a1bb65960b5720b188cf3bc8fa765eaf1f280357c8bf41e06e02dce7"),
    "oscillation-1": (3000, "bafb7b22560b9739d210e214a6866c677969dfdf3301bfd65a4e629bcd14f040"),
    "non_finite-0": (3000, "89e7a0944433203cca2346c5f239a6e9a5f47ed0e40222bf412fdd1313648fc7"),
    "non_finite-1": (3000, "c9279c5f70f0cb5679554e2e7d982b655dc8369ded2f626d9d1b802e4e040742"),
    "grad_explosion-0": (3000, "662bd31820b1a5942068387f281498963ddce470f096bd14b2a64f2c40c2a3be"),
    "grad_explosion-1": (3000, "79fdfb731454b4bc79cebb8b0dcfcd026949b28863c4951f242c08e4d00cb1f5"),
}


def test_every_scenario_is_pinned() -> None:
    assert {key.rsplit("-", 1)[0] for key in PINNED} == set(SCENARIOS)


@pytest.mark.parametrize("key", sorted(PINNED))
def test_decisions_are_those_pinned(key: str) -> None:
    scenario, seed = key.rsplit("-", 1)
    decisions = backtest_events(generate(scenario, STEPS, int(seed)).events)
    text = "\n".join(decision.model_dump_json() for decision in decisions)
    assert (len(decisions), hashlib.sha256(text.encode()).hexdigest()) == PINNED[key]
