"""How much of a run recovery may spend: a share of its data to skip, a share of its steps to re-run.

A recovery that costs more than the trouble it answers is worse than none
(a 300-step skip window for a two-step spike the run's own clipping had
absorbed). So each rollback and skip window is weighed before it is applied,
against the run's planned length (``max_steps``, else the loader's length,
else the steps run so far), with a floor of ``min_steps`` each so that a short
run may still recover: when what was spent plus what it asks would pass
the share, it is refused with a WARNING, and its REJECTED ack makes the
pipeline alert a person instead of acting.
"""

from __future__ import annotations

from typing import NamedTuple


class Spend(NamedTuple):
    """Steps' worth of recovery: re-run by rollbacks, data skipped by skip windows."""

    rerun_steps: int
    skip_steps: int


class RecoveryBudget:
    def __init__(
        self, max_skip_share: float = 0.05, max_rerun_share: float = 0.10, min_steps: int = 400
    ) -> None:
        self.max_skip_share = max_skip_share
        self.max_rerun_share = max_rerun_share
        self.min_steps = min_steps  # always allowed, each: a short run may still recover

    def refusal(self, asked: Spend, spent: Spend, planned_steps: int) -> str | None:
        """Why ``asked`` on top of ``spent`` is over budget for a run of ``planned_steps`` (None: it fits)."""
        planned = max(planned_steps, 1)
        for what, ask, used, share in (
            ("re-run", asked.rerun_steps, spent.rerun_steps, self.max_rerun_share),
            ("skip the data of", asked.skip_steps, spent.skip_steps, self.max_skip_share),
        ):
            allowed = max(int(share * planned), self.min_steps)
            if ask > 0 and used + ask > allowed:
                return (
                    f"over the recovery budget: it would {what} {ask} steps, {used} already spent, "
                    f"allowed {allowed} ({share:.0%} of {planned} planned steps, at least "
                    f"{self.min_steps}; GuardConfig max_{'rerun' if what == 're-run' else 'skip'}_share)"
                )
        return None
