"""The Guard is composed of typed collaborators, not mixins.

Its checkpoint keeper and its action applier are objects it owns, handed what
they need when they are built; they see the Guard only as a RunCursor (the
attributes declared in producers/run_cursor.py), and no module reaches into
another object's private attributes.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from producers_helpers import Tiny, action, make_guard, send, train

from spikeguard.producers import applying, checkpointing, guard as guard_module
from spikeguard.producers.applying import ActionApplier
from spikeguard.producers.checkpointing import CheckpointKeeper
from spikeguard.producers.external_loop import FrameworkGuard
from spikeguard.producers.guard import Guard
from spikeguard.producers.run_cursor import RunCursor
from spikeguard.schemas import ActionKind, AckStatus

CURSOR = set(RunCursor.__annotations__) | {"request_stop"}


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
    assert guard.checkpoints.run is guard and guard.applier.run is guard
    assert guard.applier.checkpoints is guard.checkpoints
    assert guard.checkpoints.store is guard.store and guard.applied is guard.applier.acks.applied
    guard.close()


def test_the_collaborators_touch_only_what_the_run_cursor_declares():
    for module in (checkpointing, applying):
        used = {
            node.attr
            for node in ast.walk(_tree(module))
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "run"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
        }
        assert used and used <= CURSOR, (
            f"{module.__name__} uses {sorted(used - CURSOR)} of the Guard"
        )


def test_no_module_of_the_guard_reaches_into_another_objects_private_attributes():
    for module in (checkpointing, applying, guard_module):
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
