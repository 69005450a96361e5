"""Mechanism signals judged against the run's own level: trouble the loss has not shown yet.

A trainer that opted in (producers/signals) sends, with every step, the
largest attention logit of its forward (``attention_logit_max``) and the
largest per-layer update-to-parameter ratio of its update (``update_ratio``).
Each is judged by one rule, :class:`RelativeBar`: a value above ``growth``
times the run's own level is anomalous. The level is the median of the run's
last ``window`` healthy values, never less than ``floor``: at initialisation
the logits are near zero and grow a hundredfold while the model learns to
attend (the recovery benchmark's clean runs: 0.1 at step 0, 16 by step 50),
so until the run's own level passes the floor, the bar is ``growth x floor``.
A flagged value does not teach the level (river's ``protect_anomaly_detector``):
a run whose logits run away keeps being flagged until they come back.

Which rules are on, and why (docs/instability.md has the figures):

- attention-logit growth (Wortsman et al. 2023): on. Its bar is 3 x the run's
  level, chosen on seed 0 of the lab's healthy recipe (peak ~25) and of the
  recovery benchmark's clean run (peak ~16.5), where it never fires, and of
  the benchmark's ``instability`` fault, where the logits pass 90 by step
  ~16 and reach thousands. Its floor, 30, was raised from 15 after seeds 1-5
  of the lab: the twins at LR 3e-1 (QK-norm and z-loss on) peak at 60-71, over
  3 x 15 on 3 of 5 seeds, under 3 x 30 on all;
- the update ratio: off (``growth`` inf). In the lab it crosses any bar a
  healthy run stays under in the first steps of every run at a high LR,
  the twins that train fine included: it says "this LR is high", not "a spike
  is coming".

The rules detector hosts these rules (its verdict's rule ``attention_logit_growth``);
a step without the fields is not judged by them, so a trainer that did not opt in
sees no change.

>>> bar = RelativeBar(growth=3.0, floor=30.0, window=100)
>>> level = bar.fresh()
>>> bar.judge(80.0, level)          # under 3 x 30
>>> bar.judge(100.0, level)         # over it: the value and the bar it passed
(100.0, 90.0)
"""

from __future__ import annotations

import math
from typing import Any, Collection

from pydantic import BaseModel, ConfigDict, Field

from spikeguard.processors.robust_stats import RollingMedian
from spikeguard.schemas import StepEvent

#: The rules detector's names for these rules (its verdict's ``rules``).
MECHANISM_RULES = frozenset({"attention_logit_growth", "update_ratio_high"})


class MechanismConfig(BaseModel):
    """The bars of the mechanism signals; ``growth`` inf switches a rule off."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attention_growth: float = Field(
        3.0,
        gt=1.0,
        description="a max attention logit this many times the run's level is attention-logit "
        "growth (chosen on seed 0 of the lab's healthy recipe, peak ~25, and the recovery "
        "benchmark's clean run, peak ~16.5); inf: off",
    )
    attention_floor: float = Field(
        30.0,
        gt=0.0,
        description="the level is never taken below this (nats): at initialisation the logits "
        "are near 0 and grow a hundredfold while the model learns to attend (healthy runs of "
        "the lab peak near 25, its LR 3e-1 twins at 60-71)",
    )
    update_ratio_growth: float = Field(
        math.inf,
        gt=1.0,
        description="an update ratio this many times the run's level is too high an LR; inf "
        "(default): off, since in the lab it fires on every healthy twin at a high LR",
    )
    update_ratio_floor: float = Field(
        0.02, gt=0.0, description="the update ratio's level is never taken below this"
    )
    window: int = Field(
        100, ge=3, le=4096, description="healthy steps the run's level is the median of"
    )


class RelativeBar:
    """``value > growth x max(median of the last window healthy values, floor)`` is anomalous."""

    __slots__ = ("growth", "floor", "window")

    def __init__(self, growth: float, floor: float, window: int) -> None:
        self.growth, self.floor, self.window = growth, floor, window

    @property
    def on(self) -> bool:
        return math.isfinite(self.growth)

    def fresh(self) -> RollingMedian:
        return RollingMedian(self.window)

    def bar(self, level: RollingMedian) -> float:
        median = level.get()
        return self.growth * (self.floor if not median > self.floor else median)

    def judge(self, value: float | None, level: RollingMedian) -> tuple[float, float] | None:
        """(value, bar) when ``value`` passed the bar (a non-finite value always does)."""
        if value is None or not self.on:
            return None
        bar = self.bar(level)
        if math.isfinite(value) and value <= bar:
            return None
        return value, bar

    def learn(self, value: float | None, level: RollingMedian) -> None:
        """Learn a value ``judge`` let pass (a rule that is off keeps no level)."""
        if value is not None and math.isfinite(value) and self.on:
            level.update(value)


class MechanismRules:
    """The attention-logit and update-ratio bars of one run: pure, its state a pair of windows."""

    __slots__ = ("attention", "update")

    def __init__(self, config: MechanismConfig) -> None:
        c = config
        self.attention = RelativeBar(c.attention_growth, c.attention_floor, c.window)
        self.update = RelativeBar(c.update_ratio_growth, c.update_ratio_floor, c.window)

    def fresh(self) -> MechanismLevels:
        return MechanismLevels(self.attention.fresh(), self.update.fresh())

    @staticmethod
    def carries(event: StepEvent) -> bool:
        """Whether the step carries any mechanism signal (a trainer that opted in)."""
        return event.attention_logit_max is not None or event.update_ratio is not None

    def judge(self, event: StepEvent, levels: MechanismLevels) -> dict[str, tuple[float, float]]:
        """The rules a step passed: name -> (value, bar)."""
        fired: dict[str, tuple[float, float]] = {}
        found = self.attention.judge(event.attention_logit_max, levels.attention)
        if found is not None:
            fired["attention_logit_growth"] = found
        found = self.update.judge(event.update_ratio, levels.update)
        if found is not None:
            fired["update_ratio_high"] = found
        return fired

    def learn(self, event: StepEvent, levels: MechanismLevels, fired: Collection[str]) -> None:
        """Each level learns its signal unless its own rule fired on it (the loss's anomalies
        are the loss rules' business: a spike does not make the logits abnormal)."""
        if "attention_logit_growth" not in fired:
            self.attention.learn(event.attention_logit_max, levels.attention)
        if "update_ratio_high" not in fired:
            self.update.learn(event.update_ratio, levels.update)


class MechanismLevels:
    """One run's windows of healthy attention-logit maxima and update ratios."""

    __slots__ = ("attention", "update")

    def __init__(self, attention: RollingMedian, update: RollingMedian) -> None:
        self.attention, self.update = attention, update

    def copy(self) -> MechanismLevels:
        return MechanismLevels(self.attention.copy(), self.update.copy())

    def state_dict(self) -> dict[str, Any]:
        return {"attention": self.attention.state_dict(), "update": self.update.state_dict()}

    def load_state_dict(self, data: dict[str, Any]) -> None:
        self.attention.load_state_dict(data["attention"])
        self.update.load_state_dict(data["update"])
