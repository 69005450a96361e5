"""Fusion: joining verdicts into one decision per step (table-driven where it can be)."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from spikeguard.actuators import RecoveryPolicy
from spikeguard.processors.decision_table import CRITICAL_TYPES
from spikeguard.processors.fusion import Fusion
from spikeguard.processors.fusion_config import FusionConfig
from spikeguard.schemas import ActionKind
from spikeguard.schemas import AnomalyType as T
from spikeguard.schemas import Decision, Urgency, Verdict
from spikeguard.schemas.ids import decision_id, incident_id

ALL = ("statistical", "rules", "ml", "predictor")


def v(
    detector: str,
    step: int,
    kind: T | None = None,
    conf: float = 0.9,
    critical: bool = False,
    epoch: int = 0,
    run_id: str = "r",
) -> Verdict:
    """A verdict: anomalous of ``kind`` when a kind is given, else healthy."""
    if kind is None:
        return Verdict(run_id=run_id, step=step, epoch=epoch, detector=detector, is_anomaly=False)
    return Verdict(
        run_id=run_id,
        step=step,
        epoch=epoch,
        detector=detector,
        is_anomaly=True,
        type=kind,
        confidence=conf,
        critical=critical,
        rules=[f"{detector}_{kind.value}"],
        signals={"z": 1.0},
    )


def healthy_step(step: int, but: dict[str, Verdict] | None = None, epoch: int = 0) -> list[Verdict]:
    but = but or {}
    return [but.get(d) or v(d, step, epoch=epoch) for d in ALL]


def feed(fusion: Fusion, verdicts, now: float = 0.0) -> list[Decision]:
    out: list[Decision] = []
    for verdict in verdicts:
        out += fusion.add(verdict, now)
    return out


def test_a_step_is_decided_when_every_detector_has_spoken() -> None:
    f = Fusion(run_id="r")
    verdicts = healthy_step(0)
    assert feed(f, verdicts[:3]) == []
    [d] = feed(f, verdicts[3:])
    assert (d.step, d.is_anomaly, d.missing, d.urgency) == (0, False, [], Urgency.NONE)
    assert d.decision_id == decision_id("r", 0) and set(d.detectors) == set(ALL)


@pytest.mark.parametrize("how", ["steps", "time", "cap"])
def test_deadlines_decide_with_what_there_is_and_list_the_missing(how: str) -> None:
    cfg = FusionConfig(
        deadline_steps=5, deadline_seconds=2.0, max_pending=3 if how == "cap" else 100
    )
    if how != "steps":
        cfg = cfg.model_copy(update={"deadline_steps": 10**6})
    f = Fusion(cfg, run_id="r")
    out = []
    for step in range(4 if how != "steps" else 6):
        out += feed(f, [x for x in healthy_step(step) if x.detector != "ml"], now=0.0)
    if how == "time":
        assert out == [] and f.tick(1.9) == []
        out = f.tick(2.0)
    assert out and out[0].step == 0 and out[0].missing == ["ml"]
    assert [d.step for d in out] == list(range(len(out)))


def test_a_critical_verdict_decides_alone_and_at_once() -> None:
    f = Fusion(run_id="r")
    feed(f, [v("statistical", 0), v("ml", 0)])  # step 0: still waiting for two detectors
    out = feed(
        f,
        [
            v("statistical", 1),
            v("ml", 1),
            v("predictor", 1),
            v("rules", 1, T.NON_FINITE, conf=1.0, critical=True),
        ],
    )
    assert [d.step for d in out] == [0, 1]  # the earlier step goes first, with what it had
    assert out[0].missing == ["rules", "predictor"] and not out[0].is_anomaly
    d = out[1]
    assert d.is_anomaly and d.type == T.NON_FINITE and d.urgency == Urgency.CRITICAL
    assert d.confidence == 1.0 and d.missing == [] and d.rules == ["rules_non_finite"]


def test_the_naive_average_trap() -> None:
    """Weights 0.3/0.4/0.3 and threshold 0.6: a NaN flagged by rules alone scores 0.3 and passes."""
    weights = {"rules": 0.3, "statistical": 0.4, "ml": 0.3}
    votes = {"rules": 1.0, "statistical": 0.0, "ml": 0.0}  # only rules saw the NaN (others skip it)
    naive = sum(weights[d] * votes[d] for d in weights) / sum(weights.values())
    assert naive < 0.6  # the naive fusion would let it through
    cfg = FusionConfig(weights=weights, threshold=0.6)
    f = Fusion(cfg, run_id="r")
    nan = v("rules", 0, T.NON_FINITE, conf=1.0, critical=True)
    [d] = feed(f, [v("statistical", 0), v("ml", 0), nan])
    assert d.is_anomaly and d.type == T.NON_FINITE


@pytest.mark.parametrize(
    "verdicts, kind, anomaly",
    [
        ({"statistical": (T.LOSS_SPIKE, 0.9)}, T.LOSS_SPIKE, True),  # one sure detector is enough
        (
            {"rules": (T.LR_OUT_OF_BOUNDS, 0.8), "statistical": (T.LOSS_SPIKE, 0.9)},
            T.LR_OUT_OF_BOUNDS,
            True,
        ),
        ({"ml": (T.ML_OUTLIER, 0.9), "statistical": (T.OSCILLATION, 0.7)}, T.OSCILLATION, True),
        ({"ml": (T.ML_OUTLIER, 0.9)}, T.NONE, False),  # ml alone is not enough (weight 0.5)
        (
            {"ml": (T.ML_OUTLIER, 0.9), "statistical": (T.LOSS_SPIKE, 0.2)},
            T.LOSS_SPIKE,
            True,
        ),  # together
    ],
)
def test_scoring_and_type_precedence(verdicts, kind, anomaly) -> None:
    f = Fusion(run_id="r")
    but = {d: v(d, 0, k, conf=c) for d, (k, c) in verdicts.items()}
    [d] = feed(f, healthy_step(0, but))
    assert d.is_anomaly is anomaly and d.type == kind
    if anomaly:
        assert d.signals["by"] in verdicts and d.incident_id is not None


@pytest.mark.parametrize(
    "kind, conf, critical, urgency",
    [
        (T.NON_FINITE, 1.0, True, Urgency.CRITICAL),
        (T.GRADIENT_EXPLOSION, 0.95, True, Urgency.CRITICAL),
        (T.GRADIENT_EXPLOSION, 0.9, False, Urgency.HIGH),
        (T.EXTREME_LOSS, 0.9, False, Urgency.CRITICAL),  # a critical type is critical from anyone
        (T.LOSS_SPIKE, 0.95, False, Urgency.HIGH),
        (T.LOSS_SPIKE, 0.6, False, Urgency.MEDIUM),  # unsure: one level lower
        (T.DIVERGENCE, 0.8, False, Urgency.HIGH),
        (T.OSCILLATION, 0.8, False, Urgency.MEDIUM),
        (T.LR_OUT_OF_BOUNDS, 0.8, False, Urgency.MEDIUM),
        (T.BAD_BATCH, 0.65, False, Urgency.LOW),
        (T.LOSS_SCALE_COLLAPSE, 0.8, False, Urgency.HIGH),
    ],
)
def test_urgency_and_criticality(kind, conf, critical, urgency) -> None:
    f = Fusion(run_id="r")
    [d] = feed(f, healthy_step(0, {"rules": v("rules", 0, kind, conf=conf, critical=critical)}))
    assert d.is_anomaly and d.urgency == urgency
    assert d.critical is (critical or kind in CRITICAL_TYPES)  # fusion's one rule of criticality
    assert not d.preventive


@pytest.mark.parametrize("kind", [T.INSTABILITY_WARNING, T.LR_TOO_HIGH, T.STALLED])
def test_predictor_warnings_are_preventive_and_never_roll_back(kind: T) -> None:
    f = Fusion(run_id="r")
    [d] = feed(f, healthy_step(0, {"predictor": v("predictor", 0, kind, conf=0.99)}))
    assert d.preventive and not d.is_anomaly and d.type == kind and d.urgency == Urgency.LOW
    assert d.incident_id is None and not d.critical
    assert ActionKind.ROLLBACK not in [a.kind for a in RecoveryPolicy(run_id="r").on_decision(d)]
    # with a real anomaly at the same step, the anomaly decides
    [d] = feed(
        f,
        healthy_step(
            1,
            {
                "predictor": v("predictor", 1, kind, conf=0.99),
                "statistical": v("statistical", 1, T.LOSS_SPIKE),
            },
        ),
    )
    assert d.is_anomaly and not d.preventive and d.type == T.LOSS_SPIKE
    # a weak warning is not worth a decision
    [d] = feed(f, healthy_step(2, {"predictor": v("predictor", 2, kind, conf=0.2)}))
    assert not d.preventive


def test_incidents_group_consecutive_anomalies() -> None:
    f = Fusion(FusionConfig(incident_gap_steps=5), run_id="r")
    bad = {3, 4, 7, 20, 21}
    out = []
    for step in range(25):
        but = {"statistical": v("statistical", step, T.LOSS_SPIKE)} if step in bad else None
        out += feed(f, healthy_step(step, but))
    ids = {d.step: (d.incident_id, d.incident_onset_step) for d in out if d.is_anomaly}
    assert ids[3] == ids[4] == ids[7] == (incident_id("r", 3), 3)  # gaps of <= 5 healthy steps
    assert ids[20] == ids[21] == (incident_id("r", 20), 20)  # 12 healthy steps closed the first
    assert all(d.incident_id is None for d in out if not d.is_anomaly)


def test_duplicates_are_ignored_and_late_verdicts_dropped_and_counted() -> None:
    f = Fusion(run_id="r")
    s0 = healthy_step(0, {"statistical": v("statistical", 0, T.LOSS_SPIKE)})
    out = feed(f, [s0[0], s0[0], v("statistical", 0)])  # redelivery, and a contradicting copy
    assert out == [] and f.duplicate_verdicts == 2
    [d] = feed(f, s0[1:])
    assert d.is_anomaly
    assert feed(f, s0 + [v("ml", 0, T.ML_OUTLIER)]) == []  # after the decision: no second one
    assert f.late_verdicts == 5


def test_out_of_order_arrival_still_decides_in_step_order() -> None:
    # Detectors at different speeds: any interleaving of their streams, each stream in step
    # order (a detector judges a run's steps in order: that is what its watermark means).
    rng = random.Random(0)
    streams = {d: [v(d, step) for step in range(40)] for d in ALL}
    verdicts = []
    while any(streams.values()):
        verdicts.append(streams[rng.choice([d for d in ALL if streams[d]])].pop(0))
    f = Fusion(FusionConfig(deadline_steps=10**6), run_id="r")
    out = feed(f, verdicts) + f.flush()
    assert [d.step for d in out] == list(range(40)) and all(d.missing == [] for d in out)


def test_epochs_restart_steps_and_stale_verdicts_are_dropped() -> None:
    f = Fusion(run_id="r")
    out = feed(f, healthy_step(10) + healthy_step(11)[:2])  # step 11 still pending at the rollback
    out += feed(f, healthy_step(5, epoch=1))  # the re-run after a rollback to step 5
    assert [(d.epoch, d.step) for d in out] == [(0, 10), (0, 11), (1, 5)]
    assert out[1].missing == ["ml", "predictor"]
    assert out[2].decision_id == decision_id("r", 5, 1) != decision_id("r", 5, 0)
    assert feed(f, healthy_step(11)) == [] and f.stale_verdicts == 4 and f.late_verdicts == 0


def test_state_round_trip_mid_stream_gives_identical_decisions() -> None:
    rng = random.Random(1)
    verdicts = []
    for step in range(200):
        but = {}
        if rng.random() < 0.1:
            but["statistical"] = v("statistical", step, T.LOSS_SPIKE, conf=rng.uniform(0.5, 1))
        if rng.random() < 0.05:
            but["rules"] = v("rules", step, T.NON_FINITE, conf=1.0, critical=True)
        step_verdicts = healthy_step(step, but)
        if rng.random() < 0.1:
            step_verdicts.pop(rng.randrange(4))  # a detector that never spoke
        verdicts += step_verdicts
    rng.shuffle(verdicts[300:360])  # some disorder
    cfg = FusionConfig(deadline_steps=8)
    ref = Fusion(cfg, run_id="r")
    expected = [d for i, x in enumerate(verdicts) for d in ref.add(x, float(i))] + ref.flush()
    a = Fusion(cfg, run_id="r")
    got = [d for i, x in enumerate(verdicts[:333]) for d in a.add(x, float(i))]
    b = Fusion(cfg, run_id="r")
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    got += [
        d for i, x in enumerate(verdicts[333:], start=333) for d in b.add(x, float(i))
    ] + b.flush()
    assert got == expected and len(got) == 200
    assert [d.step for d in got] == list(range(200))


def test_pending_state_is_bounded() -> None:
    f = Fusion(FusionConfig(max_pending=16, deadline_steps=10**6, deadline_seconds=1e9), run_id="r")
    out = feed(f, [v("statistical", step) for step in range(1000)])
    assert len(out) >= 1000 - 16 and len(f.state_dict()["pending"]) <= 16


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValidationError, match="threshold"):
        FusionConfig(threshold=0.0)
    with pytest.raises(ValidationError, match="incident_gap_steps"):
        FusionConfig(incident_gap_steps=0)


def test_the_decision_carries_its_evidence_and_who_said_what() -> None:
    """The step's loss and gradient norm, next to the medians of the run's recent healthy steps."""
    f = Fusion(FusionConfig(baseline_window_steps=8), run_id="r")

    def step(
        n: int, loss: float, grad: float, but: dict[str, Verdict] | None = None
    ) -> list[Verdict]:
        return [
            x.model_copy(update={"loss": loss, "grad_norm": grad}) for x in healthy_step(n, but)
        ]

    out = feed(f, step(0, 2.0, 1.0))
    assert (
        out[0].evidence is not None and out[0].evidence.loss_baseline is None
    )  # nothing learnt yet
    for n in range(1, 20):
        out += feed(f, step(n, 2.0 + 0.01 * n, 1.0 + 0.01 * n))
    spike = {"statistical": v("statistical", 20, T.LOSS_SPIKE), "ml": v("ml", 20, T.ML_OUTLIER)}
    [d] = feed(f, step(20, 9.0, 7.0, spike))
    assert d.is_anomaly and d.evidence is not None
    e = d.evidence
    assert (e.step, e.epoch, e.loss, e.grad_norm) == (20, 0, 9.0, 7.0)
    assert e.loss_baseline == pytest.approx(2.155) and e.grad_norm_baseline == pytest.approx(1.155)
    assert d.flagged_by == {"statistical": T.LOSS_SPIKE, "ml": T.ML_OUTLIER}
    # the anomalous step is not learnt: the next step's baseline is the same
    [after] = feed(f, step(21, 2.2, 1.2))
    assert after.evidence is not None and after.evidence.loss_baseline == pytest.approx(2.155)
    assert after.flagged_by == {} and not after.critical
    # it survives a state round trip and a non-finite step never becomes a baseline
    g = Fusion(FusionConfig(baseline_window_steps=8), run_id="r")
    g.load_state_dict(json.loads(json.dumps(f.state_dict())))
    nan = {"rules": v("rules", 22, T.NON_FINITE, conf=1.0, critical=True)}
    [d] = feed(g, step(22, float("nan"), 1.0, nan))
    assert (
        d.critical and d.evidence is not None and d.evidence.loss_baseline == pytest.approx(2.165)
    )


def test_without_the_step_values_there_is_no_evidence() -> None:
    [d] = feed(Fusion(run_id="r"), healthy_step(0))
    assert d.evidence is None


def test_an_unflagged_critical_type_also_decides_alone() -> None:
    """One rule of criticality (decision_table.is_critical) for deciding early and for the flag."""
    f = Fusion(run_id="r")
    feed(f, healthy_step(0))
    [d] = feed(f, [v("statistical", 1, T.EXTREME_LOSS, conf=0.9)])
    assert d.step == 1 and d.critical and d.missing == ["rules", "ml", "predictor"]


def test_a_critical_step_waits_only_for_the_steps_before_it() -> None:
    f = Fusion(run_id="r")
    assert feed(f, [v("statistical", 0), v("rules", 0)]) == []  # ml and predictor not there yet
    assert feed(f, [v("rules", 1, T.NON_FINITE, conf=1.0, critical=True)]) == []
    out = feed(f, [v("ml", 0), v("predictor", 0)])
    assert [(d.step, d.is_anomaly, d.missing) for d in out] == [
        (0, False, []),
        (1, True, ["statistical", "ml", "predictor"]),
    ]


def test_a_fast_detector_racing_ahead_does_not_change_any_decision() -> None:
    """The same run judged live (detectors in step) and after an outage (each
    catching up at its own speed) gives the same decisions; a fixed 64-steps-behind rule would not."""
    rng = random.Random(3)
    script: dict[int, dict[str, Verdict]] = {}
    for step in range(300):
        but = {}
        if rng.random() < 0.06:
            but["statistical"] = v("statistical", step, T.LOSS_SPIKE, conf=rng.uniform(0.5, 1))
        if rng.random() < 0.03:
            but["ml"] = v("ml", step, T.ML_OUTLIER, conf=0.9)
        if rng.random() < 0.02:
            but["rules"] = v("rules", step, T.NON_FINITE, conf=1.0, critical=True)
        script[step] = {x.detector: x for x in healthy_step(step, but)}
    live = [x for step in range(300) for x in script[step].values()]
    # After the outage: statistical catches up first, rules next, ml and predictor last,
    # a few seconds apart in all (under deadline_seconds), with some interleaving.
    backlog = [script[s]["statistical"] for s in range(300)] + [
        script[s]["rules"] for s in range(300)
    ]
    slow = [script[s][d] for s in range(300) for d in ("ml", "predictor")]
    caught_up = backlog[:450] + slow[:100] + backlog[450:] + slow[100:]

    def judge(verdicts: list[Verdict], config: FusionConfig) -> list[Decision]:
        f = Fusion(config, run_id="r")
        return [d for i, x in enumerate(verdicts) for d in f.add(x, now=i * 0.002)] + f.flush()

    cfg = FusionConfig()
    assert judge(caught_up, cfg) == judge(live, cfg)
    assert sum(d.is_anomaly for d in judge(live, cfg)) >= 10
    old = cfg.model_copy(update={"deadline_steps": 64})  # the timing-dependent rule, for contrast
    assert judge(caught_up, old) != judge(live, old)


def test_a_stalled_detector_is_not_waited_for_after_the_deadline() -> None:
    f = Fusion(FusionConfig(deadline_seconds=5.0), run_id="r")
    out = feed(f, healthy_step(0), now=0.0)
    out += feed(f, [x for x in healthy_step(1) if x.detector != "ml"], now=1.0)
    out += feed(f, [x for x in healthy_step(2) if x.detector != "ml"], now=2.0)
    assert [d.step for d in out] == [0]  # ml judged step 0 at t=0 and is still within its grace
    assert [d.step for d in f.tick(4.9)] == []
    late = f.tick(5.0)  # ml's watermark has not moved for 5 s: stop waiting
    assert [(d.step, d.missing) for d in late] == [(1, ["ml"]), (2, ["ml"])]
    # once it moves again it is waited for again
    out = feed(f, healthy_step(3) + [x for x in healthy_step(4) if x.detector != "ml"], now=6.0)
    assert [(d.step, d.missing) for d in out] == [(3, [])]
    assert f.tick(10.9) == [] and [d.step for d in f.tick(11.0)] == [4]


def test_after_an_outage_a_detector_alive_when_it_began_is_waited_for_up_to_the_recovery_time() -> (
    None
):
    cfg = FusionConfig(deadline_seconds=5.0, recovery_seconds=20.0)
    f = Fusion(cfg, run_id="r")
    assert [d.step for d in feed(f, healthy_step(0), now=0.0)] == [0]
    assert feed(f, [x for x in healthy_step(1) if x.detector != "ml"], now=4.9) == []
    f.resume(
        5.5, quiet_s=30.0
    )  # the outage: ml had been silent for 5.5 s when it began, the others not
    assert [(d.step, d.missing) for d in f.tick(5.5)] == [(1, ["ml"])]  # already stalled: no grace
    assert (
        feed(f, [x for x in healthy_step(2) if x.detector != "rules"], now=6.0) == []
    )  # rules lags
    assert f.tick(12.0) == []  # past its deadline, within its recovery time: waited for
    restored = Fusion(cfg, run_id="r")  # the recovery time survives a snapshot
    restored.load_state_dict(json.loads(json.dumps(f.state_dict())))
    assert restored.state_dict() == f.state_dict()
    f = restored
    assert f.tick(25.4) == []
    assert [(d.step, d.missing) for d in f.tick(25.5)] == [(2, ["rules"])]  # it died in the outage
    # Back, and past its recovery time: the usual deadline again.
    assert [d.step for d in feed(f, healthy_step(3), now=26.0)] == [3]
    assert feed(f, [x for x in healthy_step(4) if x.detector != "rules"], now=27.0) == []
    assert [(d.step, d.missing) for d in f.tick(31.0)] == [(4, ["rules"])]


def test_a_detector_that_rejoins_again_after_the_outage_is_still_waited_for() -> None:
    """Back from the outage, a consumer may fetch a little, then have its commit refused, rejoin
    and replay from its snapshot: its watermark stands still again, within the recovery time."""
    f = Fusion(FusionConfig(deadline_seconds=5.0, recovery_seconds=20.0), run_id="r")
    feed(f, healthy_step(0), now=0.0)
    f.resume(1.0, quiet_s=30.0)
    assert [d.step for d in feed(f, healthy_step(1), now=1.0)] == [1]
    assert feed(f, [x for x in healthy_step(2) if x.detector != "rules"], now=2.0) == []
    assert feed(f, [v("rules", 0), v("rules", 1)], now=3.0) == []  # its replay: no move
    assert f.tick(9.0) == []  # 8 s since it last moved, within the recovery time
    assert [(d.step, d.missing) for d in f.tick(21.0)] == [(2, ["rules"])]


def test_a_pause_shorter_than_the_deadline_is_no_outage() -> None:
    """A slow trainer's pauses between steps give a detector that died no recovery time."""
    f = Fusion(FusionConfig(deadline_seconds=5.0, recovery_seconds=20.0), run_id="r")
    feed(f, healthy_step(0), now=0.0)
    feed(f, [x for x in healthy_step(1) if x.detector != "rules"], now=1.0)
    f.resume(4.0, quiet_s=4.9)
    assert [(d.step, d.missing) for d in f.tick(5.0)] == [(1, ["rules"])]


def test_the_pipeline_s_decisions_carry_the_trainer_s_own_values() -> None:
    """Real detectors and fusion on the embedded bus: the detector stage puts each step's loss
    and gradient norm on its verdicts, so every decision's evidence is what the trainer sent."""
    from prometheus_client import CollectorRegistry

    from spikeguard.lab.backtest import backtest_events
    from spikeguard.metrics import Metrics
    from spikeguard.schemas import StepEvent

    rng = random.Random(5)
    events = []
    for step in range(300):
        loss = 3.0 * 0.999**step + rng.gauss(0, 0.02)
        grad = 1.0 + rng.gauss(0, 0.05)
        if step == 250:
            loss, grad = 40.0, 30.0
        events.append(
            StepEvent(run_id="ev", step=step, loss=loss, grad_norm=grad, lr=1e-3, time=0.0)
        )
    decisions = backtest_events(events, metrics=Metrics(CollectorRegistry()))
    assert [d.step for d in decisions] == list(range(300))
    for d, e in zip(decisions, events):
        assert d.evidence is not None and (d.evidence.loss, d.evidence.grad_norm) == (
            e.loss,
            e.grad_norm,
        )
    spike = decisions[250]
    assert spike.is_anomaly and spike.critical and set(spike.flagged_by) >= {"rules", "statistical"}
    assert spike.evidence.loss_baseline == pytest.approx(3.0 * 0.999**235, rel=0.05)
    assert spike.evidence.grad_norm_baseline == pytest.approx(1.0, rel=0.1)
