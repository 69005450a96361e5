"""The updates the live Guard would have skipped on its own, found offline.

The Guard answers an isolated outlier step in the trainer, at once, with its
skip rule (:mod:`spikeguard.producers.skip_rule`); the pipeline only hears of
it afterwards. So a backtest that shows only the pipeline's decisions hides
part of what the live run would have done. :class:`LocalSkips` runs the same
rule, with the Guard's settings, over recorded steps (one rule per run, as
each Guard has its own), and also counts what the file itself says was skipped
(``StepEvent.skip_reason``, when the steps were recorded from a live run).
:meth:`LocalSkips.live` gives each step as the live Guard would have published
it, its skip said (``update_skipped``), so that the pipeline and the policy
offline hear of the skip as they do live (an extreme loss whose update was
skipped is absorbed once the loss is back).
"""

from __future__ import annotations

from collections import Counter

from spikeguard.producers.config import GuardConfig
from spikeguard.producers.skip_rule import SkipRule
from spikeguard.schemas import StepEvent


def skip_rule_of(guard: GuardConfig) -> SkipRule | None:
    """The skip rule a Guard with ``guard`` settings runs (None when ``skip_outliers`` is off)."""
    if not guard.skip_outliers:
        return None
    return SkipRule(max_run=guard.skip_max_run)


class LocalSkips:
    """Feed steps in order (any mix of runs); :attr:`skipped` lists (run_id, step) the rule skips."""

    def __init__(self, guard: GuardConfig | None = None) -> None:
        self.guard = guard or GuardConfig()
        self.rules: dict[str, SkipRule | None] = {}
        self.skipped: list[tuple[str, int]] = []
        self.recorded: Counter[str] = Counter()  # skip_reason -> steps the file says were skipped

    def observe(self, event: StepEvent) -> bool:
        """True when the Guard's rule would skip this step's update."""
        if event.skip_reason:
            self.recorded[event.skip_reason] += 1
        if event.run_id not in self.rules:
            self.rules[event.run_id] = skip_rule_of(self.guard)
        rule = self.rules[event.run_id]
        if rule is None:
            return False
        grad = event.grad_norm if event.grad_norm is not None and event.grad_norm >= 0 else None
        skip = rule.decide(event.loss, grad, event.lr).skip  # the LR, as the live Guard hands it
        if skip:
            self.skipped.append((event.run_id, event.step))
        return skip

    def live(self, event: StepEvent) -> StepEvent:
        """``event`` as the live Guard would have published it: a step its rule skips says so
        (a step the file already records as skipped is left as it is)."""
        if self.observe(event) and not event.update_skipped:
            return event.model_copy(update={"update_skipped": True, "skip_reason": "outlier_step"})
        return event

    def summary(self, shown: int = 10) -> str:
        """One line: how many skips, the first few steps, and what the file recorded."""
        steps = ", ".join(str(step) for _, step in self.skipped[:shown])
        more = ", ..." if len(self.skipped) > shown else ""
        text = f"{len(self.skipped)} local skips by the Guard's skip rule"
        if self.skipped:
            text += f" (steps {steps}{more})"
        if self.recorded:
            text += "; recorded in the file: " + ", ".join(
                f"{n} {reason}" for reason, n in sorted(self.recorded.items())
            )
        return text
