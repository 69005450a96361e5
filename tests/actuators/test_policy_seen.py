"""The policy's window of admitted decision ids: small, and telling duplicates from late ones as before.

The aim: 10,000 runs through one actuator in <= 1 GiB. The window of ids
(1000 steps by default) was ~178 kB a run kept as id text in an OrderedDict.
"""

from __future__ import annotations

import json

from spikeguard.actuators import PolicyConfig, RecoveryPolicy
from spikeguard.schemas import Decision, decision_id
from spikeguard.streaming.footprint import deep_size

R = "run-1"


def dec(step: int, ident: str | None = None) -> Decision:
    return Decision(
        decision_id=ident or decision_id(R, step), run_id=R, step=step, is_anomaly=False
    )


def run(steps: int, **config: int) -> RecoveryPolicy:
    policy = RecoveryPolicy(PolicyConfig(**config), run_id=R)
    for step in range(steps):
        policy.on_decision(dec(step))
    return policy


def test_a_full_window_of_decision_ids_is_small() -> None:
    policy = run(3000)
    assert len(policy.seen) == policy.config.seen_window_steps + 1  # steps 1999..2999
    assert deep_size(policy.seen) <= 20 * len(policy.seen), f"{deep_size(policy.seen):,} bytes"
    assert deep_size(policy) <= 40_000, f"{deep_size(policy):,} bytes per run"


def counts_after_repeats(policy: RecoveryPolicy) -> dict[str, int]:
    for d in (
        dec(2999),
        dec(2500),
        dec(1999),  # admitted, in the window: duplicates
        dec(1998),  # admitted, but out of the window: forgotten, late
        dec(2700, "d-from-elsewhere"),  # never admitted: late
        dec(2700, decision_id(R, 2701)),  # an admitted id, though at another step: duplicate
        dec(2600, decision_id(R, 2600, epoch=1)),
    ):  # another epoch's id: late
        assert policy.on_decision(d) == []
    return dict(policy.counts)


def test_duplicates_and_late_decisions_are_told_apart_within_the_window() -> None:
    assert counts_after_repeats(run(3000)) == {"duplicate": 4, "late": 3, "abandoned": 0}


def test_the_window_survives_a_json_state_round_trip() -> None:
    policy = run(3000)
    state = json.loads(json.dumps(policy.state_dict()))
    restored = RecoveryPolicy(PolicyConfig(), run_id=R)
    restored.load_state_dict(state)
    assert restored.state_dict() == policy.state_dict()
    assert counts_after_repeats(restored) == {"duplicate": 4, "late": 3, "abandoned": 0}


def test_a_state_saved_with_id_text_still_reads() -> None:
    """Snapshots written before the ids were hashed keep them as text: they still count."""
    policy = run(3000)
    state = json.loads(json.dumps(policy.state_dict()))
    state["seen"] = [[decision_id(R, step), step] for step in range(1999, 3000)]
    restored = RecoveryPolicy(PolicyConfig(), run_id=R)
    restored.load_state_dict(state)
    assert restored.state_dict() == policy.state_dict()
    assert counts_after_repeats(restored) == {"duplicate": 4, "late": 3, "abandoned": 0}
