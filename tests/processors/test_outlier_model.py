"""The shared outlier model's tail threshold: computed once per state of its values."""

from __future__ import annotations

import random

import numpy as np

from spikeguard.processors.outlier_model import TailThreshold


def test_the_kept_threshold_is_always_the_one_its_values_give() -> None:
    rng = np.random.default_rng(5)
    tail, twin = TailThreshold(window=200, rate=1e-5, lag=20), None
    for i, value in enumerate(np.abs(rng.standard_t(3, 2000)) * 0.05):
        tail.update(float(value))
        if len(tail) >= 10:
            # threshold() may return a kept value; threshold(rate) always computes afresh.
            assert tail.threshold() == tail.threshold(tail.rate)
            assert tail.threshold() == tail.threshold()
        if i == 1000:  # a reload replaces the values: nothing kept from before may survive
            twin = TailThreshold(window=200, rate=1e-5, lag=20)
            twin.threshold()
            twin.load_state_dict(tail.state_dict())
            assert twin.threshold() == tail.threshold()


def test_an_lr_jump_beyond_the_peak_is_said_while_the_lr_stays_up_and_a_warm_restart_never() -> (
    None
):
    """A jump back to a rate the run trained at is a warm restart; one beyond it is said (with the
    loss held up after it) only while the LR is still there: once the schedule's jump is over, the
    LR no longer raises the loss, and scaling it back would cut a healthy rate."""
    import json
    import math

    from spikeguard.processors.outlier_model import OutlierModel, log_of

    def run(lrs: list[float], rise_from: int, rise_to: int) -> tuple[list[bool], list[bool]]:
        model, rng = OutlierModel(), np.random.default_rng(8)
        beyond, held = [], []
        for step, lr in enumerate(lrs):
            loss = (
                2.0 * math.exp(0.02 * rng.normal()) * (1.3 if rise_from <= step < rise_to else 1.0)
            )
            y = log_of(loss)
            judged = model.judge(y, lr)
            beyond.append(judged.lr_beyond_peak)
            held.append(judged.lr_held_rise)
            model.advance(y, judged, lr)
            twin = OutlierModel()
            twin.load_state_dict(json.loads(json.dumps(model.state_dict(), allow_nan=False)))
            assert twin.state_dict() == model.state_dict()
        return beyond, held

    decay = [1e-3 * (0.3 + 0.7 * 0.99**i) for i in range(300)]
    blowup = [lr * 20 if 200 <= i < 230 else lr for i, lr in enumerate(decay)]
    beyond, held = run(blowup, 201, 260)  # the loss stays up 30 steps after the jump ended
    assert beyond[200:230] == [True] * 30 and not any(beyond[230:]) and not any(beyond[:200])
    assert held.index(True) == 203 and not any(held[230:])
    restart = [1e-3 if 200 <= i < 230 else lr for i, lr in enumerate(decay)]  # back to the peak
    beyond, held = run(restart, 201, 230)
    assert not any(beyond) and not any(held)


def _interleaved_shift(follow_elevated: int) -> tuple[list[bool], object]:
    """A model over 600 steps of 2 % noise, then 600 at +10 % (5 sigma: only part of the noise
    clears the bar, so elevated points interleave with healthy ones); what it flagged after."""
    from spikeguard.processors.outlier_model import OutlierConfig, log_of

    model = OutlierConfig(follow_elevated=follow_elevated).model()
    rng = np.random.default_rng(1)
    flagged = []
    for step in range(1200):
        y = log_of(3.0 * (1.1 if step >= 600 else 1.0) * (1 + rng.normal(0, 0.02)))
        judged = model.judge(y)
        model.advance(y, judged)
        if step >= 600:
            flagged.append(judged.elevated)
    return flagged, model


def test_an_interleaved_elevation_moves_the_level_only_where_the_config_asks() -> None:
    """The skip rule's model follows a move up too small for a run of elevated points; the
    pipeline's (follow_elevated 0) leaves it to its level test's proportion, which tells it from
    a climb. The window of recent points round-trips through the state."""
    import json
    import math

    following, model = _interleaved_shift(3)
    waiting, _ = _interleaved_shift(0)
    assert sum(following) <= 10, sum(following)  # (the first run of them, then a few)
    assert sum(waiting) >= 20, sum(waiting)  # (the default: the censored level lags)
    assert abs(model.current_level() - math.log(3.3)) < 0.02
    twin = type(model)(model.config)
    twin.load_state_dict(json.loads(json.dumps(model.state_dict())))
    assert list(twin.recent) == list(model.recent) and twin.state_dict() == model.state_dict()


def test_a_tail_extrapolates_as_a_power_law_once_it_holds_power_from_values() -> None:
    """Before ``power_from`` values the exponential through q90 and q99; from then on the
    power law in the excess over the median (a higher bar on a heavy tail)."""
    from spikeguard.processors.outlier_model import TailThreshold

    rng = np.random.default_rng(0)
    exponential = TailThreshold(500, 1e-5)
    switching = TailThreshold(500, 1e-5, power_from=400)
    bars = []
    for i, value in enumerate(rng.standard_t(3, 500) * 0.01):
        exponential.update(float(value))
        switching.update(float(value))
        if i in (398, 499):
            bars.append((exponential.threshold(), switching.threshold()))
    (exp_young, young), (exp_full, full) = bars
    assert young == exp_young
    assert full > 1.5 * exp_full


def _t3_tail_rate(x: float, scale: float) -> float:
    """P(T > x) for scale times a Student-t with 3 degrees of freedom (closed form)."""
    import math

    u = x / scale / math.sqrt(3.0)
    return 0.5 - (u / (1.0 + u * u) + math.atan(u)) / math.pi


def test_a_heavy_tailed_healthy_tail_raises_its_own_bar_and_a_light_one_keeps_the_exponential() -> (
    None
):
    """Student-t (3 dof) residuals, a power-law tail: the exponential's bar is passed ~50x more
    often than the 1e-5 it states; the tail's own generalised Pareto shape takes part of that
    back (never more often than the exponential's, less on average). Gaussian residuals
    (lighter than exponential) keep the exponential's bar exactly: no light-tailed run moves."""
    import math

    from spikeguard.processors.outlier_model import OutlierConfig, TailThreshold

    shape_from = OutlierConfig().tail_shape_from
    assert 0 < shape_from <= OutlierConfig().tail_window
    scale = 0.02
    heavy = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        for kind, draws in (("t3", rng.standard_t(3, 500)), ("gauss", rng.standard_normal(500))):
            exponential = TailThreshold(500, 1e-5)
            shaped = TailThreshold(500, 1e-5, shape_from=shape_from)
            for value in draws * scale:
                exponential.update(float(value))
                shaped.update(float(value))
            if kind == "gauss":
                assert shaped.threshold() == exponential.threshold(), seed
                continue
            rates = (
                _t3_tail_rate(exponential.threshold(), scale),
                _t3_tail_rate(shaped.threshold(), scale),
            )
            assert rates[1] <= rates[0], (seed, rates)
            heavy.append(rates)
    exp_rate = sum(r for r, _ in heavy) / len(heavy)
    shaped_rate = sum(r for _, r in heavy) / len(heavy)
    assert exp_rate > 20 * 1e-5  # the defect: far above the stated rate
    assert shaped_rate < 0.8 * exp_rate, (shaped_rate, exp_rate)
    assert not math.isnan(shaped_rate)


def test_the_tail_threshold_kept_between_updates_is_the_one_its_values_give() -> None:
    # The threshold is kept while the values it reads (its quantiles, its top tenth) stay the
    # same: at every step it must equal one worked out afresh, however the values tie.
    rng = random.Random(3)
    for settings in (
        {},
        {"power": True},
        {"shape_from": 500},
        {"power_from": 300, "shape_from": 500},
        {"low": 0.8, "high": 0.95, "shape_from": 200},
    ):
        tail = TailThreshold(500, 1e-5, lag=20, **settings)  # type: ignore[arg-type]
        for i in range(2000):
            tail.update(round(rng.expovariate(1.0), 2))
            if i > 10:
                assert tail.threshold() == tail.threshold(tail.rate), (settings, i)
