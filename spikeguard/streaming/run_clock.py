"""How far each run has got: a record far beyond that is refused, never kept as a high-water mark.

A stage that keeps a run's newest step (fusion's decided step, the
actuator's high-water mark) treats everything at or behind it as late. One
record for step 2**53-1 would then make every real record of the run late:
one write disarms the run. So before a stage adopts a record, the run's clock
checks it against the newest (epoch, step) the stage has admitted for the run
(or its signed start): a step more than ``max_step_gap`` past the furthest
step seen, or an epoch more than ``max_epoch_gap`` past the newest, is refused
(:class:`~spikeguard.errors.RecordBeyondRunClock`: the worker sends it to the
DLQ with the reason) and the clock does not move. A rollback starts a new
epoch at an older step: that is within the clock. A run's first record may
be any step (a resumed run) unless its start said where it begins.

Signatures stop records nobody in the pipeline wrote; this bound is what
still holds without a key (``--insecure``), or against a bug upstream.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

from spikeguard.errors import RecordBeyondRunClock

#: A trainer's queue drops the oldest steps while the bus is away; this is far
#: beyond any gap that leaves, and far below a forged 2**53-1.
DEFAULT_MAX_STEP_GAP = 1_000_000
#: One epoch per rollback, and a trainer publishes steps between two rollbacks: a few epochs at
#: once (a queue that dropped a short epoch's steps) is the most a genuine record jumps.
DEFAULT_MAX_EPOCH_GAP = 16

#: How far a trainer's step may run ahead of its previous one, as a step (which carries its
#: trainer's time) is judged: this many steps, plus DEFAULT_MAX_STEPS_PER_S for every second
#: between the two steps' times. A trainer's queue drops at most its size (10,000 by default)
#: while the broker is away, and then the time between the steps pays for the rest; a forged
#: step at +500,000 would need 50 s of the run's time after its newest step.
DEFAULT_MAX_STEP_JUMP = 20_000
DEFAULT_MAX_STEPS_PER_S = 10_000
#: A step's time is taken as at most this far ahead of the worker's clock (clock skew).
MAX_CLOCK_AHEAD_S = 5.0


class RunTime(NamedTuple):
    """A run's clock: its newest epoch, and the furthest step any of its records reached."""

    epoch: int
    step: int


class RunClock:
    """The clocks of the runs a stage holds (bounded with them: :meth:`forget`)."""

    def __init__(
        self, max_step_gap: int = DEFAULT_MAX_STEP_GAP, max_epoch_gap: int = DEFAULT_MAX_EPOCH_GAP
    ) -> None:
        if max_step_gap < 1 or max_epoch_gap < 1:
            raise ValueError("RunClock: max_step_gap and max_epoch_gap must be at least 1")
        self.max_step_gap = max_step_gap
        self.max_epoch_gap = max_epoch_gap
        self.times: dict[str, RunTime] = {}

    def check(self, run_id: str, epoch: int | None, step: int, what: Callable[[], str]) -> None:
        """Raise RecordBeyondRunClock naming ``what()`` (which says the step) when (epoch, step)
        is too far past the run's clock (``what`` is called only then).

        ``epoch`` None: a record without one (an ack); its step alone is checked.
        """
        now = self.times.get(run_id)
        if now is None:
            return
        if epoch is not None and epoch - now.epoch > self.max_epoch_gap:
            raise RecordBeyondRunClock(
                f"run {run_id}: {what()} (epoch {epoch}) is more than {self.max_epoch_gap} epochs past "
                f"epoch {now.epoch}, the run's newest (far future: forged or corrupt); refused, "
                "the run's clock is unchanged"
            )
        if step - now.step > self.max_step_gap:
            raise RecordBeyondRunClock(
                f"run {run_id}: {what()} is more than {self.max_step_gap} steps past "
                f"step {now.step}, the furthest the run has published (far future: forged or corrupt); "
                "refused, the run's clock is unchanged"
            )

    def advance(self, run_id: str, epoch: int, step: int) -> None:
        """The run has published (epoch, step): its clock moves forward to it (never back)."""
        now = self.times.get(run_id)
        if now is None:
            self.times[run_id] = RunTime(epoch, step)
        elif epoch > now.epoch or step > now.step:
            self.times[run_id] = RunTime(max(epoch, now.epoch), max(step, now.step))

    def admit(self, run_id: str, epoch: int, step: int, what: Callable[[], str]) -> None:
        """:meth:`check`, then :meth:`advance`."""
        self.check(run_id, epoch, step, what)
        self.advance(run_id, epoch, step)

    def state(self, run_id: str) -> list[int] | None:
        found = self.times.get(run_id)
        return None if found is None else [found.epoch, found.step]

    def restore(self, run_id: str, state: list[int] | None) -> None:
        if state is None:
            self.times.pop(run_id, None)
        else:
            self.times[run_id] = RunTime(int(state[0]), int(state[1]))

    def forget(self, run_ids: Iterable[str]) -> None:
        for run_id in run_ids:
            self.times.pop(run_id, None)
