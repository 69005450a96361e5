"""Per-layer gradient-norm shares: the ``ml`` detector's view of a layer-local blow-up.

The total gradient norm is one number; a trainer also publishes the top-k
per-parameter gradient norms (``StepEvent.top_grad_norms``, see
:mod:`spikeguard.producers.stats`). Their *shares* of the squared total,
``(g_l / G)**2``, form a composition that is stable in a healthy run and
shifts when one layer blows up on its own: its share jumps from a few percent
to most of the total while the total norm moves less than 2x and the loss not
at all. No single-signal rule over the loss or the total norm can see that
(the statistical detector needs a 2x jump of the total norm).

The model, per run and per tracked layer, is an exponentially weighted mean and
variance of the log share (log: shares are positive and multiplicative). A step
is a ``layer_blowup`` when one reported layer's log share is at least
``z_threshold`` of its own noise above its baseline, or at least ``z_persist``
on this step and the step before (a blow-up lasts until the layer's weights have
regrown; a batch's noise does not), *and* the share is at least ``min_ratio``
times the baseline share, *and* it gained at least ``min_gain`` of the total (a
tiny layer doubling from 0.1 % is noise, not a blow-up). On small-batch healthy
runs one step's share z reaches ~4 and two steps' running minimum ~2.2, while a
10x blow-up of one layer scores 4-7 at once and >= 3.4 over two steps
(``python -m spikeguard.lab.ablation --layer-seeds 0 1 2``).

Censoring: only the top k layers are reported, so a tracked layer absent from a
step learns the smallest reported share (an upper bound of its own). Its
baseline then sits at or above the truth, which errs towards fewer alarms. A
layer never tracked is judged against the ``floor`` track (the smallest reported
share's own history), which is exactly what it would have learnt.

Learning is winsorized, as :mod:`spikeguard.processors.features` does: a value
beyond ``clip_z`` s.d. teaches only as if it were at ``clip_z``. A one-step
blow-up cannot drag its baseline, while a lasting re-balance of the layers is
followed within a few hundred steps instead of alarming for ever. Bounded: at
most ``max_layers`` tracks (the least important is evicted). No I/O.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field


class LayerConfig(BaseModel):
    """Thresholds chosen on healthy real torch runs (spikeguard.lab.layer_runs) and the unit tests'."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    warmup_steps: int = Field(
        100,
        ge=2,
        description="steps with layer norms before any verdict: the first steps of "
        "training reshuffle the shares quickly",
    )
    alpha: float = Field(
        0.02, gt=0.0, le=1.0, description="EW weight of the baselines (~50-step memory)"
    )
    z_threshold: float = Field(
        6.0,
        gt=0.0,
        description="a layer's log share this many of its noise s.d. above its baseline",
    )
    z_persist: float = Field(
        3.0,
        gt=0.0,
        description="... or this many on this step and the step before (the same layer)",
    )
    min_ratio: float = Field(
        3.0, ge=1.0, description="... and at least this many times its baseline share"
    )
    min_gain: float = Field(
        0.15,
        ge=0.0,
        lt=1.0,
        description="... and at least this much more of the squared total norm",
    )
    min_sd: float = Field(
        0.1,
        gt=0.0,
        description="floor of a share's noise s.d. (log units): a 10 % move is never news",
    )
    clip_z: float = Field(4.0, gt=0.0, description="winsorize learning at this many s.d.")
    max_layers: int = Field(64, ge=1, le=4096, description="tracked layers at most (state bound)")
    base_confidence: float = Field(
        0.6, gt=0.0, le=1.0, description="confidence at the threshold; 1 at twice the threshold"
    )


class LayerFinding(NamedTuple):
    """The most unusual reported layer of one step (whether or not it is a blow-up)."""

    layer: str
    share: float  # of the squared total norm
    share_before: float  # the baseline share (geometric mean)
    z: float  # log share above baseline, in its noise s.d. (the running two-step minimum if lower)
    grad_ratio: float  # total norm / its baseline (NaN before it has one)
    blowup: bool


def _ew(track: list[float], x: float, alpha: float, clip_z: float, floor: float) -> None:
    """One winsorized EW update of ``[mean, var]`` (in place)."""
    mean, var = track
    sd = math.sqrt(var) if var > floor * floor else floor
    limit = clip_z * sd
    d = x - mean
    d = limit if d > limit else (-limit if d < -limit else d)
    track[0] = mean + alpha * d
    track[1] = (1.0 - alpha) * (var + alpha * d * d)


class LayerShares:
    """One run's layer-share baselines: ``judge`` a step, then ``learn`` it."""

    __slots__ = ("config", "n", "floor", "total", "layers", "prev")

    def __init__(self, config: LayerConfig) -> None:
        self.config = config
        self.n = 0  # steps learnt (that carried layer norms)
        self.floor: list[float] = [0.0, 0.0]  # log of the smallest reported share: [mean, var]
        self.total: list[float] = [0.0, 0.0]  # log of the total gradient norm
        self.layers: dict[str, list[float]] = {}  # name -> [mean, var] of its log share
        self.prev: dict[str, float] = {}  # the last step's z of the layers at or above z_persist

    @staticmethod
    def shares(grad_norm: float | None, top: dict[str, float]) -> dict[str, float] | None:
        """Each reported layer's share of the squared total, or None when there is nothing to judge."""
        if len(top) < 2 or grad_norm is None or not (0.0 < grad_norm < math.inf):
            return None  # one layer's share of itself is always 1: no composition
        total_sq = grad_norm * grad_norm
        out = {name: min(g * g / total_sq, 1.0) for name, g in top.items() if 0.0 < g < math.inf}
        return out if len(out) >= 2 else None

    def judge(self, grad_norm: float, shares: dict[str, float]) -> LayerFinding | None:
        """The reported layer furthest above its baseline; None while warming up."""
        c = self.config
        if self.n < c.warmup_steps:
            return None
        best: LayerFinding | None = None
        for name, z in self._z(shares).items():
            share = shares[name]
            before = math.exp(self.layers.get(name, self.floor)[0])
            lasting = min(z, self.prev.get(name, -math.inf))
            big = share >= c.min_ratio * before and share - before >= c.min_gain
            blowup = big and (z >= c.z_threshold or lasting >= c.z_persist)
            finding = LayerFinding(name, share, before, z, math.nan, blowup)
            if best is None or (blowup, z) > (best.blowup, best.z):
                best = finding
        assert best is not None  # shares() never returns an empty map
        return best._replace(grad_ratio=grad_norm / math.exp(self.total[0]))

    def _z(self, shares: dict[str, float]) -> dict[str, float]:
        """Each reported layer's log share above its baseline, in its noise s.d."""
        floor_sd = self.config.min_sd
        out = {}
        for name, share in shares.items():
            mean, var = self.layers.get(name, self.floor)
            out[name] = (math.log(share) - mean) / (
                math.sqrt(var) if var > floor_sd * floor_sd else floor_sd
            )
        return out

    def confidence(self, finding: LayerFinding) -> float:
        """``base_confidence`` at either threshold, 1 at twice it."""
        c = self.config
        over = max(
            (finding.z - c.z_threshold) / c.z_threshold,
            (min(finding.z, self.prev.get(finding.layer, -math.inf)) - c.z_persist) / c.z_persist,
        )
        return min(1.0, c.base_confidence + (1.0 - c.base_confidence) * max(over, 0.0))

    def learn(self, grad_norm: float, shares: dict[str, float]) -> None:
        """Every step with layer norms teaches (winsorized: see the module's docstring)."""
        c = self.config
        if self.n >= c.warmup_steps:  # what the next step's persistence test compares with
            self.prev = {name: z for name, z in self._z(shares).items() if z >= c.z_persist}
        low = math.log(min(shares.values()))
        logs = {name: math.log(s) for name, s in shares.items()}
        lg = math.log(grad_norm)
        if self.n == 0:
            self.floor, self.total = [low, 0.0], [lg, 0.0]
        # Before the warm-up ends the clip is wide open: the first values set the level.
        clip = c.clip_z if self.n >= c.warmup_steps else math.inf
        for name in logs:
            if name not in self.layers:
                self.layers[name] = list(self.floor)  # it was below the reported ones until now
        for name, track in self.layers.items():
            _ew(track, logs.get(name, low), c.alpha, clip, c.min_sd)
        _ew(self.floor, low, c.alpha, clip, c.min_sd)
        _ew(self.total, lg, c.alpha, clip, c.min_sd)
        self.n += 1
        if (
            len(self.layers) > c.max_layers
        ):  # forget the least important: it is near the floor anyway
            extra = len(self.layers) - c.max_layers
            for name in sorted(self.layers, key=lambda k: self.layers[k][0])[:extra]:
                del self.layers[name]

    # -- state ---------------------------------------------------------------
    def copy(self) -> LayerShares:
        twin = LayerShares(self.config)
        twin.n, twin.floor, twin.total = self.n, list(self.floor), list(self.total)
        twin.layers = {name: list(track) for name, track in self.layers.items()}
        twin.prev = dict(self.prev)
        return twin

    def state_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "floor": list(self.floor),
            "total": list(self.total),
            "layers": {name: list(track) for name, track in self.layers.items()},
            "prev": dict(self.prev),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])
        self.floor = [float(v) for v in state["floor"]]
        self.total = [float(v) for v in state["total"]]
        self.layers = {str(k): [float(v) for v in track] for k, track in state["layers"].items()}
        self.prev = {str(k): float(v) for k, v in state["prev"].items()}
