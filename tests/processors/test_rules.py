"""The rules detector: one table row per rule, plus references, state and settings."""

from __future__ import annotations

import doctest
import json
import math
import random
import subprocess
import sys

import pytest
from pydantic import ValidationError

from spikeguard.processors.detectors import rules as rules_module
from spikeguard.processors.detectors.rules import RULES, RulesConfig, RulesDetector
from spikeguard.schemas import AnomalyType, BatchStats, StepEvent

NAN, INF = math.nan, math.inf


def step(i: int, **fields) -> StepEvent:
    base = dict(run_id="r", step=i, time=0.0, loss=3.0, grad_norm=1.0, lr=1e-3)
    base.update(fields)
    return StepEvent(**base)


def warmed(n: int = 50, config: RulesConfig | None = None, **fields) -> RulesDetector:
    det = RulesDetector(config)
    for i in range(n):
        assert not det.update(step(i, **fields)).is_anomaly
    return det


# (name, fields of the bad step, expected rule, type, critical)
CASES = [
    ("nan loss", dict(loss=NAN), "loss_non_finite", AnomalyType.NON_FINITE, True),
    ("inf loss", dict(loss=INF), "loss_non_finite", AnomalyType.NON_FINITE, True),
    ("-inf loss", dict(loss=-INF), "loss_non_finite", AnomalyType.NON_FINITE, True),
    ("nan grad norm", dict(grad_norm=NAN), "grad_norm_non_finite", AnomalyType.NON_FINITE, True),
    (
        "non-finite grads",
        dict(nonfinite_grads=3),
        "non_finite_gradients",
        AnomalyType.NON_FINITE,
        True,
    ),
    ("loss above max", dict(loss=2e4), "loss_above_max", AnomalyType.EXTREME_LOSS, True),
    ("loss x10", dict(loss=31.0), "loss_ratio", AnomalyType.EXTREME_LOSS, True),
    (
        "grad above max",
        dict(grad_norm=2e4),
        "grad_norm_above_max",
        AnomalyType.GRADIENT_EXPLOSION,
        True,
    ),
    ("lr nan", dict(lr=NAN), "lr_non_finite", AnomalyType.LR_OUT_OF_BOUNDS, False),
    ("lr negative", dict(lr=-1e-3), "lr_out_of_bounds", AnomalyType.LR_OUT_OF_BOUNDS, False),
    ("lr huge", dict(lr=50.0), "lr_out_of_bounds", AnomalyType.LR_OUT_OF_BOUNDS, False),
    ("lr jump", dict(lr=2e-2), "lr_jump", AnomalyType.LR_OUT_OF_BOUNDS, False),
    (
        "nan inputs",
        dict(batch=BatchStats(size=32, nan_inputs=1)),
        "batch_non_finite_inputs",
        AnomalyType.BAD_BATCH,
        False,
    ),
    (
        "inf inputs",
        dict(batch=BatchStats(size=32, inf_inputs=2)),
        "batch_non_finite_inputs",
        AnomalyType.BAD_BATCH,
        False,
    ),
    (
        "outliers",
        dict(batch=BatchStats(size=32, outliers=4)),
        "batch_outliers",
        AnomalyType.BAD_BATCH,
        False,
    ),
    (
        "one label",
        dict(batch=BatchStats(size=32, max_label_fraction=1.0)),
        "batch_label_imbalance",
        AnomalyType.BAD_BATCH,
        False,
    ),
]


@pytest.mark.parametrize("name, fields, rule, kind, critical", CASES, ids=[c[0] for c in CASES])
def test_each_rule_names_itself(name, fields, rule, kind, critical) -> None:
    det = warmed()
    v = det.update(step(50, **fields))
    assert v.is_anomaly and v.rules[0] == rule and v.type == kind and v.critical is critical
    assert v.detector == "rules" and v.confidence == RULES[rule][1]
    assert rule in v.message


HEALTHY = [
    ("lr zero (warm-up starts there)", dict(lr=0.0)),
    ("lr x8", dict(lr=8e-3)),
    ("loss x5", dict(loss=15.0)),
    ("grad x8 (real healthy runs have them)", dict(grad_norm=8.0)),
    ("grad x15 for one step, the loss calm (real runs: x16-x134)", dict(grad_norm=15.0)),
    ("no grad norm, no lr", dict(grad_norm=None, lr=None)),
    ("tiny batch with one label", dict(batch=BatchStats(size=4, max_label_fraction=1.0))),
    ("clean batch", dict(batch=BatchStats(size=32, outliers=1, max_label_fraction=0.5))),
    ("a loss drop", dict(loss=0.1)),
]


@pytest.mark.parametrize("name, fields", HEALTHY, ids=[c[0] for c in HEALTHY])
def test_healthy_steps_pass(name, fields) -> None:
    v = warmed().update(step(50, **fields))
    assert not v.is_anomaly and v.rules == [] and v.confidence == 0.0


def test_several_rules_fire_and_the_most_urgent_gives_the_type() -> None:
    v = warmed().update(step(50, loss=NAN, grad_norm=500.0, lr=100.0))
    assert v.rules == ["loss_non_finite", "grad_norm_ratio", "lr_out_of_bounds", "lr_jump"]
    assert v.type == AnomalyType.NON_FINITE and v.critical


def test_a_grad_norm_jump_is_an_explosion_once_it_lasts_or_the_loss_goes_with_it() -> None:
    det = warmed()
    first, second = det.update(step(50, grad_norm=30.0)), det.update(step(51, grad_norm=30.0))
    assert not first.is_anomaly and first.signals == {"grad_norm_ratio": 30.0}  # said, not flagged
    assert second.rules == ["grad_norm_ratio"] and second.type == AnomalyType.GRADIENT_EXPLOSION
    assert second.critical and second.confidence == RULES["grad_norm_ratio"][1]
    assert not det.update(step(52)).is_anomaly
    assert not det.update(step(53, grad_norm=30.0)).is_anomaly  # a new one-step jump
    with_loss = warmed().update(step(50, loss=40.0, grad_norm=30.0))
    assert with_loss.rules == ["loss_ratio", "grad_norm_ratio"] and with_loss.critical
    assert with_loss.type == AnomalyType.EXTREME_LOSS
    det = warmed(config=RulesConfig(grad_persist_steps=1))  # the old rule: an explosion at once
    assert det.update(step(50, grad_norm=30.0)).type == AnomalyType.GRADIENT_EXPLOSION
    restored = RulesDetector()
    det = warmed()
    det.update(step(50, grad_norm=30.0))
    restored.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert restored.update(step(51, grad_norm=30.0)).is_anomaly  # the count survives a restore


def test_ratio_rules_wait_for_history_and_do_not_learn_bad_steps() -> None:
    det = RulesDetector()
    assert not det.update(step(0, loss=100.0)).is_anomaly  # no history yet: only absolute limits
    det = warmed()
    for i in range(50, 100):  # a long run of x20 losses: each one is extreme, none teaches
        assert det.update(step(i, loss=60.0)).rules == ["loss_ratio"]
    assert det.update(step(100, loss=31.0)).rules == ["loss_ratio"]


def _hard_batches(n: int, seed: int) -> list[float]:
    """A healthy classification loss near zero with a hard batch now and then (2 %): each hard
    batch is x100-x4000 the usual loss, and the next batch is back."""
    rng = random.Random(seed)
    return [
        rng.uniform(0.05, 0.9) if rng.random() < 0.02 else 2e-4 * math.exp(rng.gauss(0, 1.0))
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_heavy_tailed_runs_hard_batches_are_not_extreme_once_it_came_straight_back_from_one(
    seed,
) -> None:
    events = [step(i, loss=x, grad_norm=None) for i, x in enumerate(_hard_batches(3000, seed))]
    hard = sum(e.loss > 0.04 for e in events)
    remembering = sum(v.is_anomaly for v in RulesDetector().update_many(events))
    forgetful = sum(
        v.is_anomaly for v in RulesDetector(RulesConfig(healed_memory=0)).update_many(events)
    )
    # Without the memory every hard batch is "extreme" (the bar never learns them); with it,
    # only a hard batch that comes before the run has shown it comes straight back from one.
    assert hard >= 50 and forgetful >= 0.9 * hard
    assert remembering <= 3, remembering


def test_a_held_stretch_teaches_nothing_and_a_jump_far_beyond_the_healed_one_is_extreme() -> None:
    det = warmed()  # loss 3.0
    assert det.update(step(50, loss=60.0)).rules == ["loss_ratio"]  # x20, first seen: extreme
    assert not det.update(step(51)).is_anomaly  # straight back
    assert not det.update(step(52, loss=90.0)).is_anomaly  # x30, within x10 of the jump it healed
    assert not det.update(step(53)).is_anomaly
    assert det.update(step(54, loss=5000.0)).rules == ["loss_ratio"]  # far beyond anything healed
    held = warmed()
    for i in range(50, 54):  # a stretch of x20 steps: extreme, and not a jump the run healed from
        assert held.update(step(i, loss=60.0)).rules == ["loss_ratio"]
    assert not held.update(step(54)).is_anomaly
    assert held.update(step(55, loss=60.0)).rules == ["loss_ratio"]
    brief = warmed(config=RulesConfig(healed_memory=100))
    brief.update(step(50, loss=60.0))
    for i in range(51, 250):
        assert not brief.update(step(i)).is_anomaly
    assert brief.update(step(250, loss=60.0)).rules == ["loss_ratio"]  # forgotten within 200
    again = RulesDetector()
    again.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert not again.update(step(55, loss=90.0)).is_anomaly  # the memory survives a restore


def test_the_absolute_loss_limit_yields_only_to_jumps_the_run_came_straight_back_from() -> None:
    """Squared errors of heavy-tailed targets reach 1e4 in a healthy run: a run that came
    straight back from a 3,000 is not in trouble at 12,000; one that never left 3.0 is."""
    assert warmed().update(step(50, loss=1.2e4)).rules == ["loss_above_max", "loss_ratio"]
    det = warmed()
    det.update(step(50, loss=3000.0))
    det.update(step(51))
    assert not det.update(step(52, loss=1.2e4)).is_anomaly
    assert det.update(step(53, loss=1e6)).rules == ["loss_above_max", "loss_ratio"]


def test_an_extreme_step_the_trainer_skipped_says_so() -> None:
    assert (
        warmed()
        .update(step(50, loss=60.0, update_skipped=True, skip_reason="outlier_step"))
        .signals["update_skipped"]
        == 1
    )
    assert "update_skipped" not in warmed().update(step(50, loss=60.0)).signals


def test_loss_scale_collapse() -> None:
    det = RulesDetector()
    # a GradScaler calibrating at the start halves freely
    for i, scale in enumerate([65536.0 / 2**k for k in range(6)] + [2048.0] * 40):
        assert not det.update(step(i, loss_scale=scale)).is_anomaly
    v = det.update(step(46, loss_scale=2048.0 / 2**8))
    assert v.rules == ["loss_scale_collapse"] and v.type == AnomalyType.LOSS_SCALE_COLLAPSE
    assert not v.critical
    assert warmed().update(step(50, loss_scale=0.5)).rules == ["loss_scale_collapse"]
    assert warmed().update(step(50, loss_scale=NAN)).rules == ["loss_scale_collapse"]


def test_state_round_trip_and_bounded() -> None:
    evs = [
        step(
            i,
            loss=3.0 + 0.01 * (i % 7),
            grad_norm=1.0 + 0.1 * (i % 5),
            loss_scale=1024.0,
            lr=1e-3 * (1 + i % 3),
        )
        for i in range(3000)
    ]
    evs[2500] = evs[2500].model_copy(update={"loss": 300.0})
    a = RulesDetector()
    expected = a.update_many(evs)
    b = RulesDetector()
    got = b.update_many(evs[:1200])
    c = RulesDetector()
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    got += c.update_many(evs[1200:])
    assert got == expected and sum(v.is_anomaly for v in got) == 1
    assert len(json.dumps(a.state_dict())) < 8000


def test_epoch_is_copied() -> None:
    assert RulesDetector().update(step(3, epoch=2)).epoch == 2


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValidationError, match="grad_norm_ratio"):
        RulesConfig(grad_norm_ratio=0.5)
    with pytest.raises(ValidationError, match="max_label_fraction"):
        RulesConfig(max_label_fraction=2.0)


def test_doctest() -> None:
    assert doctest.testmod(rules_module).failed == 0


def test_registry_names_every_detector_and_config() -> None:
    from pydantic import BaseModel

    from spikeguard.processors.detectors import CONFIGS, DETECTORS

    assert set(CONFIGS) == {"statistical", "rules", "ml", "predictor"}
    assert set(DETECTORS) == set(CONFIGS)
    for name, cls in DETECTORS.items():
        assert cls.name == name and issubclass(CONFIGS[name], BaseModel)
        assert cls(CONFIGS[name]()).update(step(0)).detector == name


def test_a_half_written_detector_module_fails_the_import() -> None:
    # A module that lacks its classes must stop the package, not vanish with a warning.
    code = (
        "import sys, types\n"
        "sys.modules['spikeguard.processors.detectors.ml'] = types.ModuleType('ml')\n"
        "import spikeguard.processors.detectors\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0 and "ImportError" in done.stderr and "MLConfig" in done.stderr
