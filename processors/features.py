"""Rolling, bounded feature engineering shared by the ``ml`` and ``predictor`` detectors.

Each step updates a handful of exponentially weighted statistics (O(1) memory
whatever the run length) and yields scale-free features: how far the loss is
from its recent level in units of its own noise (residual), how much faster it
moves now than usual (volatility ratio), whether the gradient norm and the
update size are trending up, whether the loss alternates (oscillation).

Features are computed *before* the step is learned ("score, then learn"), and
learning is winsorized: a value beyond ``clip_z`` standard deviations teaches
the baselines only as if it were at ``clip_z``. So a spike cannot drag the
baseline, a lasting level shift is still followed, and — what the batched ML
detector relies on — the features never depend on any detector's verdict.

>>> f = RollingFeatures()
>>> for step in range(30):
...     out = f.update(3.0 + 0.01 * (-1) ** step)
>>> out is not None and abs(out.loss_z) < 3
True
"""

from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field


class FeatureConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    fast_alpha: float = Field(
        0.1, gt=0.0, le=1.0, description="EWMA weight of the fast baselines (~10-step memory)"
    )
    slow_alpha: float = Field(
        0.01, gt=0.0, le=1.0, description="EWMA weight of the slow baselines (~100-step memory)"
    )
    scale_alpha: float = Field(
        0.01, gt=0.0, le=1.0, description="EW weight of the long-run noise variance"
    )
    vol_alpha: float = Field(
        0.1, gt=0.0, le=1.0, description="EW weight of the short-run variance (volatility)"
    )
    clip_z: float = Field(
        5.0, gt=0.0, description="winsorize learning at this many noise s.d. (spikes do not teach)"
    )
    min_steps: int = Field(
        20, ge=2, description="finite steps before features are produced (bootstrap)"
    )


class Features(NamedTuple):
    """One step's features; signals absent from the event are 0."""

    loss_z: float  # residual of the loss vs its fast baseline, in noise s.d.
    loss_step: float  # change from the previous loss, in noise s.d.
    volatility: float  # log(short-run s.d. / long-run s.d.) of the loss residual
    loss_trend: float  # (fast - slow baseline) / s.d.: > 0 when the loss creeps up
    oscillation: float  # minus the lag-1 autocorrelation of residuals (> 0: alternating)
    grad_z: float  # residual of log grad norm, in its noise s.d.
    grad_trend: float  # (fast - slow) of log grad norm / s.d.: rising gradient norm
    update_z: float  # residual of log update size (per unit LR), in its noise s.d.
    update_trend: float  # (fast - slow) of log update size / s.d.: growing updates
    step_growth: float  # (fast - slow) of log(lr * grad_norm), natural-log units

    def ml_vector(self, floor: float = -1.0) -> list[float]:
        """What the isolation forest sees (:data:`ML_FEATURES`), clamped below at ``floor``.

        The clamp is on purpose: a loss falling faster than usual or a calmer
        stretch is no trouble, and unclamped the forest flagged them; the clamped
        values pile up at the floor, where a forest never isolates them. Trends
        are left to the predictor: as forest inputs they diluted loss spikes.
        """
        return [
            x if x > floor else floor
            for x in (self.loss_z, self.loss_step, self.volatility, self.grad_z, self.update_z)
        ]


ML_FEATURES = ("loss_z", "loss_step", "volatility", "grad_z", "update_z")


_HUGE = 1e100  # residuals are clamped here before squaring (1e200 is still a float)


class _Track:
    """Fast/slow EW means and long/short EW variances of one signal (hot path: kept lean)."""

    __slots__ = (
        "n",
        "fast",
        "slow",
        "var",
        "var_short",
        "dvar",
        "last",
        "scale",
        "abs_floor",
        "rel_floor",
        "c",
    )

    def __init__(self, config: FeatureConfig, abs_floor: float, rel_floor: float) -> None:
        self.c = config
        self.abs_floor, self.rel_floor = abs_floor, rel_floor
        self.n = 0
        self.fast = self.slow = self.var = self.var_short = self.dvar = self.last = 0.0
        self.scale = abs_floor  # noise s.d. (floored), refreshed by learn()

    def noise_sd(self) -> float:
        # From step-to-step differences: unlike the residual from the lagging fast
        # mean, it does not swell when the signal trends, so a trend stays visible.
        sd = math.sqrt(0.5 * self.dvar)
        floor = self.abs_floor + self.rel_floor * abs(self.fast)
        return sd if sd > floor else floor

    def learn(self, x: float) -> float:
        """Learn ``x``; returns the residual it was learned with (clipped once warm)."""
        c = self.c
        n = self.n = self.n + 1
        r = x - self.fast
        if not -_HUGE < r < _HUGE:  # absurd but finite values (1e300) must not overflow the squares
            r = math.copysign(_HUGE, r)
            x = self.fast + r
        if n == 1:
            self.fast = self.slow = x
            r = 0.0
        elif n <= c.min_steps:  # bootstrap: running means, no noise scale to clip against yet
            if not -10.0 * (abs(self.fast) + 1.0) <= r <= 10.0 * (abs(self.fast) + 1.0):
                self.n -= 1  # absurd (early training moves fast, but not 10x): not learned at all
                return 0.0
            a = 1.0 / n
            self.fast += max(c.fast_alpha, a) * r
            self.slow += max(c.slow_alpha, a) * (x - self.slow)
            self.var += max(c.scale_alpha, a) * (r * r - self.var)
            self.var_short += max(c.vol_alpha, a) * (r * r - self.var_short)
            self.dvar += max(c.scale_alpha, a) * ((x - self.last) * (x - self.last) - self.dvar)
        else:
            bound = c.clip_z * self.scale
            if r > bound:
                r = bound
            elif r < -bound:
                r = -bound
            x = self.fast + r  # the winsorized value is what the baselines learn
            self.fast += c.fast_alpha * r
            self.slow += c.slow_alpha * (x - self.slow)
            rr = r * r
            self.var += c.scale_alpha * (rr - self.var)
            self.var_short += c.vol_alpha * (rr - self.var_short)
            d = x - self.last
            self.dvar += c.scale_alpha * (d * d - self.dvar)
        self.last = x
        sd = math.sqrt(self.var)
        floor = self.abs_floor + self.rel_floor * abs(self.fast)
        self.scale = sd if sd > floor else floor
        return r

    def trend(self) -> float:
        return (self.fast - self.slow) / self.noise_sd()

    def state(self) -> list[float]:
        return [
            self.n,
            self.fast,
            self.slow,
            self.var,
            self.var_short,
            self.dvar,
            self.last,
            self.scale,
        ]

    def copy(self) -> _Track:
        # Spelled out: a getattr/setattr loop over __slots__ cost 3x as much (hot path).
        twin = _Track.__new__(_Track)
        twin.n, twin.fast, twin.slow, twin.var = self.n, self.fast, self.slow, self.var
        twin.var_short, twin.dvar, twin.last, twin.scale = (
            self.var_short,
            self.dvar,
            self.last,
            self.scale,
        )
        twin.abs_floor, twin.rel_floor, twin.c = self.abs_floor, self.rel_floor, self.c
        return twin

    def load(self, s: list[float]) -> None:
        self.n = int(s[0])
        self.fast, self.slow, self.var, self.var_short, self.dvar, self.last, self.scale = (
            float(v) for v in s[1:]
        )


#: Steps already peeked, shared by every RollingFeatures in the process (see
#: :meth:`RollingFeatures.peek_event`): (content key, id(event)) -> (event, features, after).
_PEEKED: dict[tuple[Any, int], tuple[Any, "Features | None", "RollingFeatures"]] = {}
#: Two batches of look-ahead (the ML detector peeks a worker's whole batch, 2000 records
#: at most offline, before judging it; the predictor comes after it); the oldest go first.
#: Each entry holds an event and a features object, a few KiB: the cache stays ~10-15 MiB.
PEEK_CACHE_SIZE = 4096
_unique_keys = itertools.count(1)


def _log_pos(x: float | None) -> float | None:
    return math.log(x) if x is not None and x > 0.0 and math.isfinite(x) else None


class RollingFeatures:
    """Bounded per-run state turning raw step values into :class:`Features`."""

    def __init__(self, config: FeatureConfig | None = None) -> None:
        self.config = config or FeatureConfig()
        c = self.config
        self._loss = _Track(c, 1e-8, 1e-4)  # noise floor: 0.01% of the loss level
        self._grad = _Track(c, 1e-3, 0.0)  # log scale: 0.1% relative change
        self._upd = _Track(c, 1e-3, 0.0)
        self._step = _Track(c, 1e-3, 0.0)
        self._prev_loss = math.nan
        self._prev_resid = 0.0
        self._cov1 = 0.0  # EW mean of r_t * r_(t-1): negative when the loss alternates
        # Names this object's content: equal keys, equal content. Fresh objects of equal
        # configs are equal; a copy keeps its original's key; whatever changes in place
        # gets a key of its own.
        self._key: Any = ("fresh", self.config)

    @property
    def ready(self) -> bool:
        return self._loss.n >= self.config.min_steps

    @property
    def loss_level(self) -> float:
        """The slow loss baseline (NaN before the first finite loss): what "improving" means."""
        return self._loss.slow if self._loss.n else math.nan

    def update(
        self,
        loss: float,
        grad_norm: float | None = None,
        lr: float | None = None,
        update_norm: float | None = None,
        param_norm: float | None = None,
    ) -> Features | None:
        """Features of this step (None while bootstrapping or for a non-finite loss), then learn."""
        if not math.isfinite(loss):
            return None  # a non-finite value teaches nothing; the caller judges it
        self._key = next(_unique_keys)  # changed in place: no longer equal to any other
        c = self.config
        lt, gt, ut, st = self._loss, self._grad, self._upd, self._step
        warm = lt.n >= c.min_steps
        lg = math.log(grad_norm) if grad_norm is not None and 0.0 < grad_norm < math.inf else None
        lu = ls = None
        if update_norm is not None:  # relative to the parameters and per unit LR, when known
            size = update_norm / param_norm if param_norm else update_norm
            lu = _log_pos(size / lr if lr is not None and lr > 0.0 else size)
        if lr is not None and lg is not None and 0.0 < lr < math.inf:
            ls = math.log(lr) + lg
        # Score first (against what came before) ...
        loss_z = (loss - lt.fast) / lt.scale
        prev = self._prev_loss
        step = (loss - prev) / lt.scale if warm and prev == prev else 0.0  # NaN after a restart
        grad_z = (lg - gt.fast) / gt.scale if lg is not None and gt.n >= c.min_steps else 0.0
        update_z = (lu - ut.fast) / ut.scale if lu is not None and ut.n >= c.min_steps else 0.0
        # ... then learn (winsorized).
        r = lt.learn(loss)
        self._cov1 += c.vol_alpha * (r * self._prev_resid - self._cov1)
        self._prev_resid, self._prev_loss = r, loss
        if lg is not None:
            gt.learn(lg)
        if lu is not None:
            ut.learn(lu)
        if ls is not None:
            st.learn(ls)
        if not warm:
            return None
        var_short = lt.var_short if lt.var_short > 1e-300 else 1e-300
        return Features(
            loss_z,
            step,
            0.5 * math.log(var_short / (lt.var if lt.var > 1e-300 else 1e-300)),
            lt.trend(),
            -self._cov1 / var_short,
            grad_z,
            gt.trend() if gt.n >= c.min_steps else 0.0,
            update_z,
            ut.trend() if ut.n >= c.min_steps else 0.0,
            st.fast - st.slow if st.n >= c.min_steps else 0.0,
        )

    def update_event(self, event: Any) -> Features | None:
        """:meth:`update` from a StepEvent."""
        return self.update(
            event.loss, event.grad_norm, event.lr, event.update_norm, event.param_norm
        )

    def copy(self) -> RollingFeatures:
        """An independent copy (the config is shared: it is frozen)."""
        twin = RollingFeatures.__new__(RollingFeatures)
        twin.config, twin._key = self.config, self._key
        twin._loss, twin._grad = self._loss.copy(), self._grad.copy()
        twin._upd, twin._step = self._upd.copy(), self._step.copy()
        twin._prev_loss, twin._prev_resid, twin._cov1 = (
            self._prev_loss,
            self._prev_resid,
            self._cov1,
        )
        return twin

    def peek_event(self, event: Any) -> tuple[Features | None, RollingFeatures]:
        """What :meth:`update_event` would return, and the features after it; ``self`` unchanged.

        Lets a detector score a step without learning it; adopting the returned
        copy is then the same as having called :meth:`update_event`.

        The result is a pure function of this object's content and the event, so
        it is computed once per process: the ML detector peeks a batch ahead and
        again when it judges it, and the predictor's features, which learn the
        same finite steps from the same start, have the same content (a
        key, not a comparison, says so). The returned object may thus be shared:
        it is never changed in place here, and must not be elsewhere (change a
        :meth:`copy`). The event is held by the cache, so its ``id`` is not reused.
        """
        key = (self._key, id(event))
        hit = _PEEKED.get(key)
        if hit is not None and hit[0] is event:
            return hit[1], hit[2]
        after = self.copy()
        features = after.update_event(event)
        after._key = next(_unique_keys)  # also when update_event learnt nothing: a new object
        if len(_PEEKED) >= PEEK_CACHE_SIZE:
            _PEEKED.pop(next(iter(_PEEKED)), None)  # the oldest
        _PEEKED[key] = (event, features, after)
        return features, after

    def restart(self) -> None:
        """After a rollback: the next loss does not follow the previous one."""
        self._key = next(_unique_keys)
        self._prev_loss = math.nan
        self._prev_resid = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss": self._loss.state(),
            "grad": self._grad.state(),
            "update": self._upd.state(),
            "step": self._step.state(),
            "prev": [self._prev_loss, self._prev_resid, self._cov1],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._key = next(_unique_keys)
        for key, track in (
            ("loss", self._loss),
            ("grad", self._grad),
            ("update", self._upd),
            ("step", self._step),
        ):
            track.load(state[key])
        self._prev_loss, self._prev_resid, self._cov1 = (float(v) for v in state["prev"])
