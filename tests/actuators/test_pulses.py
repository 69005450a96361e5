"""Every decided step is named by a pulse within ``pulse_interval_s``, whether or not more decisions come.

The finding: pulses went out only with a decision, at most one per interval. A trainer that
paused after a burst of steps (an evaluation, a long save) kept the burst's tail waiting for a
pulse until it trained again, and after ``unprotected_after_s`` called itself NOT protected
(and set its gauge) though every step had been judged. Here the real actuator stage holds the
decisions its interval held back and pulses the newest once the interval has passed, from its
tick (the worker ticks after every poll, an empty one too).
"""

from __future__ import annotations

import time

from spikeguard.actuators import PolicyConfig, RecoveryPolicy
from spikeguard.actuators.actuator_stage import ActuatorStage
from spikeguard.schemas import ActionKind, Decision, RunEvent, Topics
from spikeguard.streaming.batch_transaction import rewind

R = "pulsed-run"
TOPICS = Topics()
INTERVAL_S = 10.0


def _stage() -> ActuatorStage:
    return ActuatorStage(
        TOPICS,
        lambda run_id, config=None: RecoveryPolicy(config or PolicyConfig(), run_id=run_id),
        pulse_interval_s=INTERVAL_S,
    )


def _decisions(steps: range, session: str | None = None) -> list[tuple[str, Decision]]:
    return [
        (
            TOPICS.decisions,
            Decision(decision_id=f"d-{s}", run_id=R, step=s, is_anomaly=False, session=session),
        )
        for s in steps
    ]


def _pulses(outputs) -> list[tuple[int, str | None]]:
    return [(a.params.judged_step, a.session) for _, a in outputs if a.kind == ActionKind.PULSE]


def test_the_newest_decision_the_interval_held_back_is_pulsed_once_the_interval_has_passed():
    stage = _stage()
    started = time.time()
    assert _pulses(stage.handle_batch(_decisions(range(0, 40)))) == [(0, None)]
    assert _pulses(stage.tick(started + 1.0)) == []  # the interval has not passed
    assert _pulses(stage.tick(started + INTERVAL_S + 1.0)) == [(39, None)]
    assert _pulses(stage.tick(started + 3 * INTERVAL_S)) == []  # nothing new was decided


def test_a_held_pulse_carries_its_session_and_a_newer_session_drops_it():
    session, newer = "0" * 15 + "1", "0" * 15 + "2"
    stage = _stage()
    started = time.time()
    stage.handle_batch(_decisions(range(0, 10), session))
    assert _pulses(stage.tick(started + INTERVAL_S + 1.0)) == [(9, session)]
    stage.handle_batch(_decisions(range(10, 20), session))  # held: pulsed 0 s ago (wall clock)
    stage.handle_batch(_decisions(range(0, 1), newer))  # the run's trainer restarted
    # Step 19 of the old session is no step of the new trainer's: no pulse names it.
    assert _pulses(stage.tick(started + 3 * INTERVAL_S)) == []


def _start(lockstep: bool | None) -> list[tuple[str, RunEvent]]:
    return [(TOPICS.runs, RunEvent(run_id=R, kind="start", lockstep=lockstep))]


def test_a_lockstep_run_is_pulsed_at_every_decision_after_its_actions():
    """Its trainer waits for the pulse of each step (producers/lockstep.py): every decision is
    pulsed, at once, and after the actions it caused."""
    stage = _stage()
    stage.handle_batch(_start(True))
    assert _pulses(stage.handle_batch(_decisions(range(0, 5)))) == [(s, None) for s in range(5)]
    plain = _stage()
    plain.handle_batch(_start(None))
    assert _pulses(plain.handle_batch(_decisions(range(0, 5)))) == [(0, None)]


def test_a_restored_actuator_still_pulses_a_lockstep_run_at_every_decision():
    """The actuator restarted from its snapshot (a worker's restart) keeps pulsing the lockstep
    run's every decision; without it the trainer waited ``lockstep_timeout`` for a pulse and
    fell back to a timed wait, its actions landing when they arrived."""
    stage = _stage()
    stage.handle_batch(_start(True))
    stage.handle_batch(_decisions(range(0, 3)))
    restarted = _stage()
    restarted.restore(stage.snapshot([R]))
    assert _pulses(restarted.handle_batch(_decisions(range(3, 6)))) == [
        (s, None) for s in range(3, 6)
    ]
    # A batch undone (batch_transaction.rewind) takes the start back with it.
    fresh = _stage()
    before = fresh.undo_point({R})
    fresh.handle_batch(_start(True))
    rewind(fresh, {R}, before)
    assert _pulses(fresh.handle_batch(_decisions(range(0, 3)))) == [(0, None)]
