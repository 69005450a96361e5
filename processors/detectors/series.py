"""Online robust monitor of one positive training signal (loss or gradient norm) in log space.

Four tests on ``y = log(x)``, all one-sided towards "worse" where that is right:

* **spike** — the point's distance above the rolling median of the last
  ``level_window`` accepted points, in units of the robust noise scale. The
  median is taken *before* the point joins it, so the point is never part of
  the baseline it is compared with. A jump that heals at the next step is
  what healthy runs do (batch-induced one-step jumps of up to ~x2 and ~18
  noise units are common in real LLM logs), so a moderate jump is only a
  *candidate*; it is confirmed once the signal has stayed up by ``retain`` of
  the jump for ``confirm_steps`` steps (sooner if the follow-up is itself
  ``z_confirm`` out). A jump beyond ``z_instant`` noise units or
  ``instant_jump`` in log units is flagged at once (delay 0).
* **divergence** — a slow climb, Page-Hinkley style: a slow EMA of accepted
  points rises above its own running minimum (which forgets slowly) by more
  than ``div_min`` in log units and more than ``div_z`` noise units of the
  EMA. The trend of healthy training is downward, so only a rise counts; a
  spike's fading tail does not (the level restarts when a spike ends).
* **oscillation** — the signal swings ever wider: a short EWMA of the
  detrended first differences (each difference minus the local slope, so a
  fast benign descent or a steady climb does not count) grows to
  ``osc_level`` times its long-run level. Each difference is clipped, so one
  spike (up, then down) cannot make an oscillation.
* **alternation** — a swing that flips sign every step (a period-2
  oscillation) at ``alt_level`` times the long-run swing size, while the
  one-step swings are ``alt_ratio`` times the two-step ones (``y_t - y_{t-2}``,
  detrended the same way). For independent noise of any distribution, growing
  or not, the two are equal in expectation (each is the difference of two
  independent draws); a flip-flop's two-step swing is only its noise. So
  noise that grows, which the swing ratio alone cannot tell from an
  instability, does not alternate. The highs must also rise: a short EWMA of
  the higher of each two points in a row, ``alt_lift`` one-step swings above
  the same at half the weight. A healthy run that cycles through two fixed
  batches alternates too, its gap growing as the lower batch falls; its highs
  do not rise.

:meth:`judge` changes nothing; :meth:`advance` moves on what every point
moves (swing sizes, the episode: a candidate's age, a confirmed spike);
:meth:`learn` learns a point judged normal. Flagged points (and candidates)
are not learnt, so a spike cannot drag the baseline up; the noise scale also
stops learning while deviations are wide.
A non-finite value is never passed in (the detector skips it), so it cannot
poison anything. All state is O(``level_window``).
"""

from __future__ import annotations

import math
from typing import Any

from spikeguard.processors.robust_stats import RollingMedian

# Result codes of SeriesMonitor.update.
OK, CANDIDATE, SPIKE, DIVERGENCE, OSCILLATION, WARMUP, ALTERNATION = range(7)
# E|x_t - x_{t-1}| = 2 sigma / sqrt(pi) for Gaussian noise
_MEAN_ABS_DIFF_TO_SIGMA = math.sqrt(math.pi) / 2.0


def _alternation(one: float, two: float) -> float:
    """One-step over two-step swing size (1 until there is a two-step swing)."""
    return one / two if two > 0.0 else 1.0


#: What SeriesMonitor.judge returns: code, z, jump, swing ratio, swing state, episode state.
Judged = tuple[int, float, float, float, tuple, tuple]


class SeriesMonitor:
    """One signal's state. Parameters are plain floats (see StatisticalConfig for meanings)."""

    __slots__ = (
        # parameters
        "level_window",
        "warmup",
        "scale_alpha",
        "min_scale",
        "z_spike",
        "min_jump",
        "z_instant",
        "instant_jump",
        "retain",
        "confirm_steps",
        "z_confirm",
        "z_exit",
        "div_alpha",
        "div_forget",
        "div_z",
        "div_min",
        "osc_alpha",
        "osc_ref_alpha",
        "osc_level",
        "calm_level",
        "relearn_after",
        "alt_level",
        "alt_ratio",
        "alt_lift",
        # learned state
        "_med",
        "_smean",
        "_sn",
        "_level_sigma",
        "_last",
        "_level",
        "_floor",
        "_ln",
        "_vprev",
        "_vprev2",
        "_slope",
        "_vshort",
        "_vref",
        "_one",
        "_two",
        "_high",
        "_high_slow",
        "_vn",
        "_osc",
        "_pending",
        "_age",
        "_run",
        "_run_kind",
        "_n",
    )

    def __init__(
        self,
        *,
        level_window: int,
        warmup: int,
        scale_alpha: float,
        min_scale: float,
        z_spike: float,
        min_jump: float,
        z_instant: float,
        instant_jump: float,
        retain: float,
        confirm_steps: int,
        z_confirm: float,
        z_exit: float,
        div_alpha: float,
        div_forget: float,
        div_z: float,
        div_min: float,
        osc_alpha: float,
        osc_ref_alpha: float,
        osc_level: float,
        calm_level: float,
        relearn_after: int,
        alt_level: float,
        alt_ratio: float,
        alt_lift: float,
    ) -> None:
        self.level_window = level_window
        self.warmup = warmup
        self.scale_alpha = scale_alpha
        self.min_scale = min_scale
        self.z_spike = z_spike
        self.min_jump = min_jump
        self.z_instant = z_instant
        self.instant_jump = instant_jump
        self.retain = retain
        self.confirm_steps = confirm_steps
        self.z_confirm = z_confirm
        self.z_exit = z_exit
        self.div_alpha = div_alpha
        self.div_forget = div_forget
        self.div_z = div_z
        self.div_min = div_min
        self.osc_alpha = osc_alpha
        self.osc_ref_alpha = osc_ref_alpha
        self.osc_level = osc_level
        self.calm_level = calm_level
        self.relearn_after = relearn_after
        self.alt_level = alt_level
        self.alt_ratio = alt_ratio
        self.alt_lift = alt_lift
        self._med = RollingMedian(level_window)
        # noise of the slow level, per unit of noise of the signal
        self._level_sigma = math.sqrt(div_alpha / (2.0 - div_alpha))
        self._smean = 0.0
        self._sn = 0
        self.reset()

    def reset(self, keep_scale: bool = False) -> None:
        self._med.clear()
        if not keep_scale:
            self._smean = 0.0  # EW mean |first difference| of accepted points, outliers clipped
            self._sn = 0
        self._last = math.nan  # last accepted value
        self._level = math.nan  # slow EMA of accepted values
        self._ln = 0  # points in it since it (re)started
        self._floor = math.nan  # its running minimum, forgetting slowly
        self._vprev = math.nan  # previous value seen by the oscillation test
        self._vprev2 = math.nan  # the one before it (two-step swings)
        self._slope = 0.0  # EWMA of first differences (local slope)
        self._vshort = 0.0  # short EWMA of |difference - slope|
        self._vref = 0.0  # its long-run level
        self._one = 0.0  # short EWMA of |difference - slope|, not clipped (the alternation)
        self._two = 0.0  # short EWMA of |two-step difference - 2 slope|, not clipped
        self._high = math.nan  # short EWMA of the higher of each two points in a row
        self._high_slow = math.nan  # the same at half the weight (twice the delay)
        self._vn = 0  # differences seen by the oscillation test
        self._osc = 1.0  # swing ratio of the last point (what learn() needs of it)
        self._pending = 0.0  # jump of a spike candidate awaiting confirmation (0: none)
        self._age = 0  # steps it has stayed up so far
        self._run = 0  # consecutive flagged points
        self._run_kind = OK
        self._n = 0  # accepted points

    def sigma(self) -> float:
        """The robust noise scale in log units (floored at ``min_scale``)."""
        s = self._smean * _MEAN_ABS_DIFF_TO_SIGMA
        return s if s > self.min_scale else self.min_scale

    def judge(self, y: float) -> Judged:
        """Judge ``y`` (finite, log space) against what came before; changes nothing.

        ``code, z, jump = judged[:3]``: z is the standardised distance above the
        baseline (or the divergence / oscillation statistic for those codes; the
        swing ratio for an alternation),
        jump the distance in log units. The rest is what :meth:`advance` applies.
        """
        osc, alternation, lift, swings = self._volatility(y)
        code, z, r, episode = self._decide(y, osc, alternation, lift)
        return code, z, r, osc, swings, episode

    def advance(self, judged: Judged) -> int:
        """What every point moves on, flagged or not: the swing sizes and the episode state.

        ``judged`` is what :meth:`judge` returned for this point. Returns the
        point's code; :meth:`learn` then learns it when the caller judged it normal.
        """
        code, _, _, osc, swings, (pending, age, spike_over, level) = judged
        (
            self._vprev,
            self._vprev2,
            self._slope,
            self._vn,
            self._vshort,
            self._vref,
            self._one,
            self._two,
            self._high,
            self._high_slow,
        ) = swings
        self._osc = osc
        if code == WARMUP:
            return WARMUP
        self._pending, self._age = pending, age
        if spike_over:
            self._run = 0
            self._run_kind = OK
            # The spike's slowly fading tail is not a new climb: the slow level
            # starts afresh from here (a climb from here on is still caught).
            self._level = math.nan
            self._ln = 0
        if code in (SPIKE, DIVERGENCE, OSCILLATION, ALTERNATION):
            if code == DIVERGENCE:
                self._level = level  # a climb is followed, or the rise would be frozen
            self._flag(code)
        elif code == OK and self._run_kind != OK:
            self._run = 0
            self._run_kind = OK
        return code

    def learn(self, y: float) -> None:
        """Learn ``y`` as a normal point (after :meth:`advance` of the same point)."""
        self._learn(y, self._osc)

    def alternation(self) -> float:
        """Short-run one-step over two-step swing size after the last point (about 1 for
        independent noise, growing or not; large for a flip-flop)."""
        return _alternation(self._one, self._two)

    def _decide(
        self,
        y: float,
        osc: float,
        alternation: float,
        lift: float,
    ) -> tuple[int, float, float, tuple]:
        """The code of ``y`` and the episode state after it: (pending, age, spike over, level)."""
        if self._n < self.warmup:
            return WARMUP, 0.0, 0.0, (self._pending, self._age, False, self._level)
        sig = self._smean * _MEAN_ABS_DIFF_TO_SIGMA
        if sig < self.min_scale:
            sig = self.min_scale
        r = y - self._med.get()
        z = r / sig
        pending = self._pending
        age = self._age
        spike_over = False
        level = self._level
        ln = self._ln
        # A spike already confirmed: stays flagged until it has come down.
        if self._run_kind == SPIKE:
            if z >= self.z_exit and r >= 0.5 * self.min_jump:
                return SPIKE, z, r, (0.0, age, False, level)
            spike_over = True
            level, ln = math.nan, 0
        # A candidate is confirmed when it has not healed: still up by ``retain`` of its jump for
        # ``confirm_steps`` steps, or at once when the follow-up is itself far out.
        elif (
            pending > 0.0 and z >= self.z_exit and r >= self.retain * pending and r >= self.min_jump
        ):
            age += 1
            if (
                age >= self.confirm_steps
                or z >= self.z_confirm
                or z >= self.z_instant
                or r >= self.instant_jump
            ):
                return SPIKE, z, r, (0.0, age, spike_over, level)
            return CANDIDATE, z, r, (pending, age, spike_over, level)
        age = 0
        if z >= self.z_spike and r >= self.min_jump:
            if z >= self.z_instant or r >= self.instant_jump:
                return SPIKE, z, r, (0.0, age, spike_over, level)
            return CANDIDATE, z, r, (r, age, spike_over, level)
        # Oscillation and divergence: slower evidence, from points that are not spikes.
        if osc >= self.osc_level:
            return OSCILLATION, osc, r, (0.0, age, spike_over, level)
        if osc >= self.alt_level and alternation >= self.alt_ratio and lift >= self.alt_lift:
            return ALTERNATION, osc, r, (0.0, age, spike_over, level)
        if ln >= self.warmup:
            climbed = level + self.div_alpha * (y - level)
            rise = climbed - self._floor
            level_sigma = sig * self._level_sigma
            if rise >= self.div_min and rise >= self.div_z * level_sigma:
                return DIVERGENCE, rise / level_sigma, rise, (0.0, age, spike_over, climbed)
        return OK, z, r, (0.0, age, spike_over, level)

    def _flag(self, code: int) -> None:
        self._run += 1
        self._run_kind = code
        if self._run >= self.relearn_after:
            # Flagged for so long that this is the new normal (or nobody is
            # acting on the alarms): start over from here rather than alarm forever.
            self.reset(keep_scale=True)

    def _volatility(self, y: float) -> tuple[float, float, float, tuple]:
        """Short-run over long-run detrended swing size (about 1 for steady noise), and the
        alternation: short-run one-step over two-step swing size (about 1 for independent
        noise, growing or not; large for a flip-flop).

        Every point counts here, spikes included (clipped for the swing size; not for the
        alternation, where a one-point spike makes two one-step and two two-step swings
        of its size). Returns both, the highs' lift (in one-step swings) and the swing
        state after ``y``: (previous value, the one before, slope, count, short,
        long-run, one-step, two-step, highs, highs at half the weight).
        """
        prev, prev2 = self._vprev, self._vprev2
        if prev != prev:
            return (
                1.0,
                1.0,
                0.0,
                (
                    y,
                    prev,
                    self._slope,
                    self._vn,
                    self._vshort,
                    self._vref,
                    self._one,
                    self._two,
                    self._high,
                    self._high_slow,
                ),
            )
        d = y - prev
        a = self.osc_alpha
        dev = abs(d - self._slope)
        slope = self._slope + a * (d - self._slope)
        # Each average starts at its first swing (an average from 0 would start low).
        one = self._one + a * (dev - self._one) if self._one > 0.0 else dev
        two = self._two
        if prev2 == prev2:
            # The two-step swing, detrended by the same slope as the one-step swing.
            dev2 = abs(y - prev2 - 2.0 * self._slope)
            two = two + a * (dev2 - two) if two > 0.0 else dev2
        alternation = _alternation(one, two)
        # The highs: the higher of each two points in a row, at two delays. A growing
        # flip-flop lifts them; a loss that falls, or whose lower half falls, does not.
        upper = y if y > prev else prev
        high = self._high + a * (upper - self._high) if self._high == self._high else upper
        high_slow = (
            self._high_slow + 0.5 * a * (upper - self._high_slow)
            if self._high_slow == self._high_slow
            else upper
        )
        lift = (high - high_slow) / one if one > 0.0 else 0.0
        vn = self._vn + 1
        ref = self._vref
        if vn <= 1:  # the first difference seeds both averages
            seed = dev if dev > 0.0 else 1e-12
            return 1.0, 1.0, 0.0, (y, prev, slope, vn, seed, seed, one, two, high, high_slow)
        floor = ref if ref > self.min_scale else self.min_scale
        cap = 5.0 * floor
        if dev > cap:
            dev = cap
        vshort = self._vshort + a * (dev - self._vshort)
        ratio = vshort / floor
        # The long-run level is a running mean at first, then an EWMA that
        # learns fully while calm and only slowly while swings are wide, so a
        # growing oscillation stands out while a lasting change of the noise
        # level is eventually accepted.
        rate = 1.0 / vn
        if rate < self.osc_ref_alpha:
            rate = self.osc_ref_alpha if ratio < self.calm_level else 0.125 * self.osc_ref_alpha
        return (
            ratio,
            alternation,
            lift,
            (y, prev, slope, vn, vshort, ref + rate * (dev - ref), one, two, high, high_slow),
        )

    def _learn(self, y: float, osc: float) -> None:
        last = self._last
        # Wide swings mean oscillation may be building: do not learn them as noise
        # (during warm-up everything is learned: there is no noise level yet).
        if last == last and (osc < self.calm_level or self._n < self.warmup):
            # EW mean of |difference|, a running mean until 1/scale_alpha points;
            # a difference beyond 4x the mean counts as 4x (one outlier moves it little).
            a = abs(y - last)
            m = self._smean
            if self._sn and a > 4.0 * m:
                a = 4.0 * m
            self._sn += 1
            rate = 1.0 / self._sn
            if rate < self.scale_alpha:
                rate = self.scale_alpha
            self._smean = m + rate * (a - m)
        self._last = y
        self._med.update(y)
        self._n += 1
        # The slow level: a running mean at first, then an EWMA. Its best
        # (lowest) value follows it until ``warmup`` points are in, so that
        # one lucky low point cannot set the bar.
        ln = self._ln = self._ln + 1
        level = self._level
        rate = 1.0 / ln
        if rate < self.div_alpha:
            rate = self.div_alpha
        level = y if ln == 1 else level + rate * (y - level)
        self._level = level
        floor = self._floor
        if ln <= self.warmup or level < floor:
            self._floor = level
        else:
            self._floor = floor + self.div_forget * (level - floor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "med": self._med.state_dict(),
            "scale_mean": self._smean,
            "scale_n": self._sn,
            "last": self._last,
            "level": self._level,
            "floor": self._floor,
            "vprev": self._vprev,
            "vprev2": self._vprev2,
            "slope": self._slope,
            "vshort": self._vshort,
            "vref": self._vref,
            "one": self._one,
            "two": self._two,
            "high": self._high,
            "high_slow": self._high_slow,
            "vn": self._vn,
            "pending": self._pending,
            "age": self._age,
            "run": self._run,
            "run_kind": self._run_kind,
            "n": self._n,
            "ln": self._ln,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._med.load_state_dict(state["med"])
        self._smean = float(state["scale_mean"])
        self._sn = int(state["scale_n"])
        self._last = float(state["last"])
        self._level = float(state["level"])
        self._floor = float(state["floor"])
        self._vprev = float(state["vprev"])
        self._vprev2 = float(state.get("vprev2", math.nan))
        self._slope = float(state["slope"])
        self._vshort = float(state["vshort"])
        self._one = float(state.get("one", 0.0))
        self._two = float(state.get("two", 0.0))
        self._high = float(state.get("high", math.nan))
        self._high_slow = float(state.get("high_slow", math.nan))
        self._vref = float(state["vref"])
        self._vn = int(state["vn"])
        self._pending = float(state["pending"])
        self._age = int(state["age"])
        self._run = int(state["run"])
        self._run_kind = int(state["run_kind"])
        self._n = int(state["n"])
        self._ln = int(state["ln"])
