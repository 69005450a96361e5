"""The Guard is composed of typed collaborators, not mixins.

Its checkpoint keeper, its action applier (which owns the run's steering) and
the step's two halves are objects it owns, handed what they need when they are
built, over one RunState (producers/run_state.py); none is handed the Guard,
and no module reaches into another object's private attributes.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from producers_helpers import Tiny, action, make_guard, send, train

from spikeguard.producers import (
    applying,
    checkpointing,
    external_loop,
    guard as guard_module,
    step_halves,
    steering,
)
from spikeguard.producers.applying import ActionApplier
from spikeguard.producers.checkpointing import CheckpointKeeper
from spikeguard.producers.external_loop import FrameworkGuard
from spikeguard.producers.guard import Guard
from spikeguard.producers.run_state import RunState
from spikeguard.producers.steering import Steering
from spikeguard.producers.step_halves import StepHalves
from spikeguard.schemas import ActionKind, AckStatus

PARTS = (applying, checkpointing, steering, step_halves)


def _tree(module) -> ast.AST:
    return ast.parse(Path(inspect.getsourcefile(module)).read_text())


def test_the_guard_inherits_nothing_but_owns_its_keeper_and_applier(bus, tmp_path):
    assert Guard.__bases__ == (object,)
    assert FrameworkGuard.__mro__ == (FrameworkGuard, Guard, object)
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path)
    assert isinstance(guard.checkpoints, CheckpointKeeper) and isinstance(
        guard.applier, ActionApplier
    )
    assert isinstance(guard.state, RunState)
    assert isinstance(guard.applier.steering, Steering) and guard.steering is guard.applier.steering
    assert isinstance(guard.halves, StepHalves)
    for part in (guard.checkpoints, guard.applier, guard.steering, guard.halves, guard.acks):
        assert part.run is guard.state
        assert not any(value is guard for value in vars(part).values()), part
    assert guard.applier.checkpoints is guard.checkpoints
    assert guard.checkpoints.store is guard.store and guard.applied is guard.applier.acks.applied
    guard.close()


def test_no_part_imports_the_guard():
    """The parts are handed the run's state, never the Guard: none can reach back into it."""
    for module in PARTS:
        imported = {
            node.module
            for node in ast.walk(_tree(module))
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert "spikeguard.producers.guard" not in imported, module.__name__


def test_no_module_of_the_guard_reaches_into_another_objects_private_attributes():
    for module in (*PARTS, guard_module, external_loop):
        reached = sorted(
            f"{ast.unparse(node)} (line {node.lineno})"
            for node in ast.walk(_tree(module))
            if isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        )
        assert reached == [], f"{module.__name__}: {reached}"


def test_a_checkpoint_action_goes_through_the_keeper_and_is_acked_once_on_disk(bus, tmp_path):
    tiny = Tiny()
    guard = make_guard(tiny, bus, tmp_path, checkpoint_every=0)
    train(guard, tiny, 3)
    wanted = action(ActionKind.CHECKPOINT, 3, reason="on_demand")
    send(bus, wanted, guard=guard)
    before = guard.counters["checkpoints"]
    train(guard, tiny, 4)
    guard.saver.wait()
    guard.checkpoints.drain()
    acks = [a for a in guard.applied if a["action_id"] == wanted.action_id]
    assert [a["status"] for a in acks] == [AckStatus.APPLIED.value]
    assert guard.counters["checkpoints"] == before + 1
    assert guard.checkpoints.requests == []
    guard.close()


def test_the_guard_declares_every_part_assembly_builds():
    """The Guard's typed declarations and assembly.GuardParts name the same parts."""
    from dataclasses import fields

    from spikeguard.producers.assembly import GuardParts

    assert set(Guard.__annotations__) == {f.name for f in fields(GuardParts)}
