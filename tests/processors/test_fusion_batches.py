"""Fusion.add_many decides whole groups at once: always what add() makes of the same verdicts."""

from __future__ import annotations

import json
import random

import pytest

from spikeguard.processors.fusion import Fusion
from spikeguard.processors.fusion_config import FusionConfig
from spikeguard.schemas import AnomalyType, Verdict

DETECTORS = ["statistical", "rules", "ml", "predictor"]


def verdict(rng: random.Random, step: int, epoch: int, detector: str) -> Verdict:
    roll = rng.random()
    kind, anomaly, critical = AnomalyType.NONE, False, False
    if roll < 0.04:
        kind, anomaly = AnomalyType.LOSS_SPIKE, True
    elif roll < 0.05:
        kind, anomaly = AnomalyType.NON_FINITE, True  # critical by type
    elif roll < 0.06:
        kind, anomaly, critical = AnomalyType.GRADIENT_EXPLOSION, True, True
    elif roll < 0.09 and detector == "predictor":
        kind, anomaly = AnomalyType.INSTABILITY_WARNING, True
    return Verdict(
        run_id="r",
        step=step,
        epoch=epoch,
        detector=detector,
        is_anomaly=anomaly,
        type=kind,
        critical=critical,
        confidence=rng.random() if anomaly else 0.1,
        loss=1.0 + rng.random(),
        grad_norm=rng.random(),
    )


def stream(seed: int) -> list[tuple[float, list[Verdict]]]:
    """Batches of verdicts with their wall times: mostly whole steps, with every irregularity
    a live pipeline shows (lagging, missing, repeated, late, critical, stale; rollbacks; a
    detector fusion does not expect; stalls)."""
    rng = random.Random(seed)
    out: list[Verdict] = []
    epoch, step, held = 0, 0, []
    for _ in range(1500):
        group = [verdict(rng, step, epoch, d) for d in DETECTORS]
        roll = rng.random()
        if roll < 0.05:
            group.pop(rng.randrange(len(group)))  # a detector dropped the step
        elif roll < 0.08:
            held.append(group.pop(rng.randrange(len(group))))  # it comes later
        elif roll < 0.10:
            group.append(group[rng.randrange(len(group))])  # at-least-once: a repeat
        elif roll < 0.12:
            group.insert(rng.randrange(len(group) + 1), verdict(rng, step, epoch, "extra"))
        elif roll < 0.15:
            rng.shuffle(group)
        if held and rng.random() < 0.3:
            group += held  # late or lagging verdicts, maybe for steps already decided
            held = []
        out += group
        step += 1
        if rng.random() < 0.01:  # a rollback: a new epoch re-runs some steps
            epoch, step = epoch + 1, max(0, step - rng.randint(1, 30))
            out.append(verdict(rng, step, epoch - 1, "rules"))  # a stale one
    batches, now, i = [], 0.0, 0
    while i < len(out):
        size = rng.choice([1, 3, 4, 7, 50, 400])
        now += rng.choice([0.0, 0.01, 0.5, 3.0, 6.0])  # 6 s: past the 5 s deadline
        batches.append((now, out[i : i + size]))
        i += size
    return batches


def dumped(decisions) -> list[str]:
    return [d.model_dump_json() for d in decisions]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(
    "config",
    [
        FusionConfig(),
        FusionConfig(deadline_steps=0),
        FusionConfig(deadline_steps=3, max_pending=2),
        FusionConfig(expected=["statistical", "rules"]),
    ],
)
def test_add_many_is_add_verdict_by_verdict(seed: int, config: FusionConfig) -> None:
    batched, one_by_one = Fusion(config, run_id="r"), Fusion(config, run_id="r")
    got, expected = [], []
    for now, verdicts in stream(seed):
        got += batched.add_many(verdicts, now)
        for v in verdicts:
            expected += one_by_one.add(v, now)
        got += batched.tick(now + 1.0)
        expected += one_by_one.tick(now + 1.0)
    got += batched.flush()
    expected += one_by_one.flush()
    assert dumped(got) == dumped(expected)
    assert json.dumps(batched.state_dict()) == json.dumps(one_by_one.state_dict())
    assert (batched.late_verdicts, batched.duplicate_verdicts, batched.stale_verdicts) == (
        one_by_one.late_verdicts,
        one_by_one.duplicate_verdicts,
        one_by_one.stale_verdicts,
    )
    assert any(d.is_anomaly for d in expected) and any(d.missing for d in expected)


def test_whole_groups_take_the_short_way() -> None:
    """The batch path is the one a backtest's batches take: no step waits in the pending set."""
    rng = random.Random(1)
    fusion = Fusion(FusionConfig(), run_id="r")
    verdicts = [verdict(rng, s, 0, d) for s in range(200) for d in DETECTORS]
    verdicts = [v for v in verdicts if not v.is_anomaly]
    whole = [
        v
        for s in range(200)
        if len(group := [v for v in verdicts if v.step == s]) == 4
        for v in group
    ]
    calls = 0
    add = fusion._add

    def counted(*args):
        nonlocal calls
        calls += 1
        return add(*args)

    fusion._add = counted  # type: ignore[method-assign]
    decisions = fusion.add_many(whole, 0.0)
    assert len(decisions) == len(whole) // 4 and calls == 0
