"""What the Guard says about what it does: one WARNING line per action that changes the run,
and a one-paragraph summary of the whole run.

Every line a person reads names what was done, why (the action's reason),
what it costs (steps to re-run, batches skipped, the LR the next update
uses) and the incident it answers. Actions the Guard does not take (observe
mode, skip-only mode, past the recovery budget) get the same line as what it
*would* have done, and the reason it did not. Python shows WARNING by
default, so none of this needs a logging set-up.

The summary is what ``guard.close()`` logs and returns and ``guard.summary()``
gives at any time: incidents, actions taken and withheld, and the goodput —
the steps kept, the steps re-run after rollbacks, the batches skipped and
the updates skipped.
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, NamedTuple, Protocol

from spikeguard.schemas import Action, ActionKind
from spikeguard.schemas.actions import ClipParams

if TYPE_CHECKING:
    from spikeguard.producers.run_state import RunState

log = logging.getLogger("spikeguard.producers.guard")


class ActionLogger(Protocol):
    """Where else actions are told (TensorBoard, W&B: spikeguard/integrations/loggers.py)."""

    def action(self, step: int, action: Action, applied: bool, text: str) -> None: ...


def send(loggers: list[ActionLogger], step: int, action: Action, applied: bool, text: str) -> None:
    """To every logger; one that fails is dropped with a WARNING (training goes on)."""
    for logger in list(loggers):
        try:
            logger.action(step, action, applied, text)
        except Exception as exc:  # noqa: BLE001 - a logger's failure never reaches the training loop
            loggers.remove(logger)
            log.warning(
                "spikeguard: %s failed (%s: %s); actions are no longer sent there",
                type(logger).__name__,
                type(exc).__name__,
                exc,
            )


#: Kinds that change the run; ALERT only informs, CHECKPOINT only saves.
STEERING = frozenset(ActionKind) - {ActionKind.ALERT, ActionKind.CHECKPOINT}
#: Kinds whose line always says the LR they leave (the others say it only if they moved it).
LR_KINDS = frozenset(
    {ActionKind.SET_LR, ActionKind.SCALE_LR, ActionKind.RESTORE_LR, ActionKind.HOLD_LR}
)


def label(action: Action) -> str:
    """An action's name in the lines and the summary: its kind; a CLIP that lifts, ``lift_clip``
    (on the wire both are ``clip``, but one sets clipping and the other gives it back)."""
    if isinstance(action.params, ClipParams) and action.params.lifts:
        return "lift_clip"
    return action.kind.value


class Cost(NamedTuple):
    """What the run had spent on recovery at one moment (differences give an action's cost)."""

    step: int
    rerun_steps: int
    skipped_batches: int
    skipped_steps: int
    lr: float


class RunSummary(NamedTuple):
    """The run as the Guard saw it; ``str()`` is the paragraph ``close()`` logs."""

    run_id: str
    mode: str
    steps_kept: int  # the step counter: steps whose place in the run survived
    steps_run: int  # every step, the re-run ones included
    steps_rerun: int  # steps run again after rollbacks
    batches_skipped: int  # batches skip windows dropped
    steps_skipped: int  # the same, in optimizer steps' worth of data
    updates_skipped: (
        int  # optimizer updates the Guard skipped (non-finite, outlier, a re-run's verdict)
    )
    incidents: int
    actions: dict[str, int]  # applied, by kind
    withheld: dict[str, int]  # not applied (mode or budget), by kind
    lr_scale: float  # the Guard's factor on the schedule now
    notices: dict[str, int] = {}  # alerts and requested checkpoints applied: they steer nothing
    recovery_clip: str = ""  # clipping a recovery set that is still in force ("": none)
    clip_lifted: str = ""  # when and to what the clipping recoveries set was given back ("": never)

    def __str__(self) -> str:
        def kinds(counts: dict[str, int]) -> str:
            return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"

        text = (
            f"spikeguard run {self.run_id} ({self.mode} mode): {self.steps_kept} steps kept of "
            f"{self.steps_run} run; {self.steps_rerun} re-run after rollbacks, "
            f"{self.batches_skipped} batches ({self.steps_skipped} steps' data) skipped, "
            f"{self.updates_skipped} update(s) skipped. {self.incidents} incident(s); "
            f"actions applied: {kinds(self.actions)}; withheld: {kinds(self.withheld)}"
        )
        text += f"; also applied: {kinds(self.notices)}." if self.notices else "."
        if self.lr_scale != 1.0:
            text += f" The LR ends at {self.lr_scale:.3g}x its schedule."
        if self.recovery_clip:
            text += f" Gradients stay clipped at {self.recovery_clip} (set by a recovery)."
        elif self.clip_lifted:
            text += f" The clipping a recovery set was lifted {self.clip_lifted}."
        return text


@dataclass
class Streak:
    """One line said, and how often it came again since."""

    what: str
    first: int  # the step it was said at
    last: int  # the step it came last
    again: int = 0


class Repeats:
    """A line that comes step after step says nothing new after the first time: it is said once,
    the rest are counted, and the count said when the streak ends (``gap`` steps without it, a
    rollback to before it, or ``end()`` at the run's close)."""

    def __init__(self, gap: int = 100) -> None:
        self.gap = gap
        self.streaks: dict[Hashable, Streak] = {}

    def first(self, key: Hashable, step: int, what: str, gap: int | None = None) -> bool:
        """Whether to say this line now (else it was counted); ``gap``: this line's own."""
        streak = self.streaks.get(key)
        gap = self.gap if gap is None else gap
        if streak is not None and 0 <= step - streak.last <= gap:
            streak.last, streak.again = step, streak.again + 1
            return False
        self.end(key)
        self.streaks[key] = Streak(what, step, step)
        return True

    def end(self, key: Hashable | None = None) -> None:
        """Say the count of the streak ``key`` (None: of every streak), and forget it."""
        for k in list(self.streaks) if key is None else [key]:
            streak = self.streaks.pop(k, None)
            if streak is not None and streak.again:
                log.warning(
                    "spikeguard: %s: said at step %d, and the same %d more time(s) up to step %d",
                    streak.what,
                    streak.first,
                    streak.again,
                    streak.last,
                )


#: Steps without an alert after which the same alert is a new episode, said again. A LOW alert of
#: a run's own wander can come back every ~100 steps for the whole run (one line each, 503 lines
#: in 40k steps of a converged run): its episode is the stretch it keeps coming back in.
ALERT_EPISODE_GAP = 1000

#: An alert's numbers (step, confidence, sizes): the same alert but for them is the same line.
_NUMBERS = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


class Narrator:
    """Says each action out loud and keeps the tallies of the summary."""

    def __init__(self, run_id: str, loggers: list[ActionLogger] | None = None) -> None:
        self.run_id = run_id
        self.repeats = Repeats()
        self.loggers = loggers if loggers is not None else []  # TensorBoard, W&B: opt-in
        self.applied: Counter[str] = Counter()
        self.withheld: Counter[str] = Counter()
        self.incidents: set[str] = set()
        self.rerun_steps = 0
        self.clip_lifted = ""

    def took(self, action: Action, result: str, before: Cost, after: Cost) -> None:
        """An action that changed the run: one WARNING line with its cost.

        Each line's cost is true when it is said: the LR is named by the actions that set it, and
        by any other only if it moved the LR (a rollback's checkpoint had another); so the LR a
        recovery leaves is on the line of its LR action, after its rollback's."""
        name = label(action)
        self.applied[name] += 1
        if name == "lift_clip":
            self.clip_lifted = f"at step {before.step} ({result.rpartition(': ')[2]})"
        self._incident(action)
        rerun = before.step - after.step if action.kind is ActionKind.ROLLBACK else 0
        self.rerun_steps += max(rerun, 0)
        costs = []
        if rerun > 0:
            costs.append(f"{rerun} steps to re-run")
        if after.skipped_batches > before.skipped_batches:
            costs.append(
                f"{after.skipped_batches - before.skipped_batches} batches skipped "
                f"({after.skipped_steps - before.skipped_steps} steps' data)"
            )
        moved = not math.isclose(after.lr, before.lr, rel_tol=1e-9)
        if action.kind is ActionKind.ROLLBACK and moved:
            costs.append(f"LR back to the checkpoint's {after.lr:.3g}")
        elif action.kind in LR_KINDS or moved:
            costs.append(f"LR now {after.lr:.3g}")
        text = (
            f"spikeguard: {name} at step {before.step}: {result}; why: "
            f"{_why(action)}; cost: {', '.join(costs) or 'no steps, data or LR'}{_of(action)}"
        )
        log.warning("%s", text)
        if self.loggers:
            send(self.loggers, before.step, action, True, text)

    def withhold(self, action: Action, would: str, because: str, step: int) -> None:
        """An action not taken: what it would have done, and why it was not."""
        name = label(action)
        self.withheld[name] += 1
        self._incident(action)
        what = f"would {name.replace('_', ' ')}, not done: {because}"
        text = (
            f"spikeguard: would {name.replace('_', ' ')} at step {step} ({would}), "
            f"not done: {because}; why it was asked: {_why(action)}{_of(action)}"
        )
        if self.repeats.first((name, because), step, what):
            log.warning("%s", text)
        if self.loggers:
            send(self.loggers, step, action, False, text)

    def summary(
        self, run: RunState, mode: str, lr_scale: float, notices: dict[str, int], clip: str
    ) -> RunSummary:
        """The run so far (``clip``: the clipping a recovery set that is still in force)."""
        c = run.counters
        return RunSummary(
            run.run_id,
            mode,
            run.step_count,
            c.steps,
            self.rerun_steps,
            c.skipped_batches,
            c.skipped_steps,
            c.skipped_updates,
            len(self.incidents),
            dict(self.applied),
            dict(self.withheld),
            lr_scale,
            notices,
            clip,
            self.clip_lifted,
        )

    def alert(self, step: int, severity: str, message: str) -> None:
        """An alert's line, once per episode: the same alert but for its numbers, coming again
        within ``ALERT_EPISODE_GAP`` steps of its last, is counted, and the count said when the
        episode ends (every alert is still applied, handed to handlers and counted)."""
        key = ("alert", severity, _NUMBERS.sub("#", message))
        if self.repeats.first(key, step, f"alert ({severity}) {message!r}", ALERT_EPISODE_GAP):
            log.warning("spikeguard alert (%s): %s", severity, message)

    def would_skip_update(self, step: int, reason: str, kind: str = "") -> None:
        """``kind``: the skip's reason code; a streak of one kind is said once, then counted."""
        self.withheld["skip_update"] += 1
        what = f"would skip the update ({kind.replace('_', ' ') or reason}), not done: observe mode"
        if self.repeats.first(("skip_update", kind or reason), step, what):
            log.warning(
                "spikeguard: would skip the update of step %d (%s), not done: observe mode",
                step,
                reason.replace("_", " "),
            )

    def _incident(self, action: Action) -> None:
        if action.incident_id:
            self.incidents.add(action.incident_id)


def would_do(action: Action) -> str:
    """What an action asks for, in words (its parameters)."""
    fields = action.params.model_dump(mode="json", exclude_none=True)
    return ", ".join(f"{k}={v}" for k, v in fields.items()) or "no parameters"


def _why(action: Action) -> str:
    return action.reason or "no reason given"


def _of(action: Action) -> str:
    return f" (incident {action.incident_id})" if action.incident_id else ""
