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

#: scenario-seed: (decisions, sha256 of their JSON lines), the default settings.
#: Re-pinned when decisions gained `session` (null offline) and the detectors' tails began to
#: learn from healthy points only, with the climb test calibrated on its own past (every scenario).
PINNED = {
    "data_shift-0": (3000, "b83a56f3f50435277a99bc1e36a60aad71b11264cb134135972be0e060727253"),
    "data_shift-1": (3000, "3694d6ead15de0ad1348cfca30729dc476e796749255c4012c9be0a55bfd43eb"),
    "divergence-0": (3000, "f03ebbc722fcda1fec44248cccf044f1af6d473d4364459c3b3ef5abddc4a836"),
    "divergence-1": (3000, "16376d1dbe244b9629f5ef9f50c98bd73479f64a18c0f11a794de2ffee9fbb7d"),
    "eval_bumps-0": (3000, "73d5b21dec064071bc7c344294ef136971c9d2bd0ad7d93a7c9d5367647b5917"),
    "eval_bumps-1": (3000, "16a80167c7554255e02c5c1d6c42844ea85f915a7b0e307e9aa3a7bf79a9eab4"),
    "grad_explosion-0": (3000, "4e31337782498de6a2435f374b651a1477c6110e9060e459757d39ae6ec8d8ce"),
    "grad_explosion-1": (3000, "c416c31dd764f37359fed35b9b60197d3405051db99144f75b3ccf2931f8b2c2"),
    "gradual_spike-0": (3000, "f5614e3f9a3270d4bbb8f9da9d5d331b9fadf6da8ebde474fef4700a4973a225"),
    "gradual_spike-1": (3000, "a8cecf34a892bc7fcdf4f8bb0432d88dd386bd3e3810108c838f53ea352065b2"),
    "heavy_tailed-0": (3000, "fd1801c5854ed388dad8486fa5dd1e5662eb63c393895e6f07645bacde6c9f80"),
    "heavy_tailed-1": (3000, "bae9958d1b30fcdc0c1f224f533a7cf02f840e6e2ed73fd50c2b4f3f6718ff2b"),
    "non_finite-0": (3000, "731df3bc84b308e3efcc1b1530c4a900e551e602a409c1f7627ef9af770a4dd4"),
    "non_finite-1": (3000, "a130a5824dee5e97ed3bb507bcc11d8d319844bd697b57788b402ce3f0e0c6f4"),
    "oscillation-0": (3000, "e3edb83d96da4b006ba75005334705ed424b97542934933f435b31404ff2679a"),
    "oscillation-1": (3000, "808b59bc3e444f4e092710e1a4fe828e0817fe59db4ffa483836bb2205c7d6ab"),
    "stable-0": (3000, "42382001c346c3d5f44b3401a949856cfe3d47f6790dd8f7fcf1e1839ad78809"),
    "stable-1": (3000, "d87cfa9a24a3f9f8b03e58f10bbafab75addee7c0710c11624f2147137baa670"),
    "sudden_spike-0": (3000, "87d0ee4ad42493ec23f7089770e650deca10c766bc91ce2fe02ed2dc3c867a27"),
    "sudden_spike-1": (3000, "5dfcf3615c3f909dc0c433a3e1c8a49350745a5081e370e7f5f04029d0765bfc"),
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
