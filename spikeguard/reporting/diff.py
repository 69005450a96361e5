"""What changed between a recorded judgement and a replayed one: decisions and actions.

Decisions are matched by ``(run, epoch, step)``; a decision counts when it is
anomalous or preventive. Actions are matched by ``(run, kind, apply_at_step)``
and differ when their parameters do. Rollbacks and LR restores that appear
or vanish are named: they are what a person wants to know first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from spikeguard.schemas import Action, ActionKind, Decision
from spikeguard.schemas.actions import ActionParams

NOTABLE = ("rollback", "restore_lr")


@dataclass
class Diff:
    added: list = field(default_factory=list)
    removed: list = field(default_factory=list)
    changed: list = field(default_factory=list)  # (before, after)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


def _decisions(items: Iterable[Decision]) -> dict[tuple, Decision]:
    return {(d.run_id, d.epoch, d.step): d for d in items if d.is_anomaly or d.preventive}


def _actions(items: Iterable[Action]) -> dict[tuple, Action]:
    # A pulse tells a live trainer it is judged; a replay has no trainer, and sends none.
    return {
        (a.run_id, a.kind.value, a.apply_at_step): a
        for a in items
        if a.kind is not ActionKind.PULSE
    }


def _what(d: Decision) -> tuple:
    return (d.type.value, d.urgency.value, d.is_anomaly, d.preventive)


def diff_decisions(before: Iterable[Decision], after: Iterable[Decision]) -> Diff:
    old, new = _decisions(before), _decisions(after)
    return Diff(
        added=[new[k] for k in sorted(new.keys() - old.keys())],
        removed=[old[k] for k in sorted(old.keys() - new.keys())],
        changed=[
            (old[k], new[k])
            for k in sorted(old.keys() & new.keys())
            if _what(old[k]) != _what(new[k])
        ],
    )


def diff_actions(before: Iterable[Action], after: Iterable[Action]) -> Diff:
    old, new = _actions(before), _actions(after)
    return Diff(
        added=[new[k] for k in sorted(new.keys() - old.keys())],
        removed=[old[k] for k in sorted(old.keys() - new.keys())],
        changed=[
            (old[k], new[k])
            for k in sorted(old.keys() & new.keys())
            if old[k].params != new[k].params
        ],
    )


def _decision(d: Decision) -> str:
    kind = "preventive" if d.preventive and not d.is_anomaly else d.type.value
    return f"run {d.run_id} step {d.step} (epoch {d.epoch}): {kind}, {d.urgency.value}"


def _params(params: ActionParams) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(params.items())) or "no parameters"


def _action(a: Action) -> str:
    return f"run {a.run_id} {a.kind.value} at step {a.apply_at_step} ({_params(a.params)})"


def render(decisions: Diff, actions: Diff) -> list[str]:
    """Printable lines: + added, - removed, ~ changed; notable actions named at the end."""
    lines = [
        f"decisions: {len(decisions.added)} added, {len(decisions.removed)} removed, "
        f"{len(decisions.changed)} changed"
    ]
    lines += [f"  + {_decision(d)}" for d in decisions.added]
    lines += [f"  - {_decision(d)}" for d in decisions.removed]
    for old, new in decisions.changed:
        lines.append(
            f"  ~ run {old.run_id} step {old.step} (epoch {old.epoch}): "
            f"{old.type.value}, {old.urgency.value} -> {new.type.value}, {new.urgency.value}"
        )
    lines.append(
        f"actions: {len(actions.added)} added, {len(actions.removed)} removed, "
        f"{len(actions.changed)} changed"
    )
    lines += [f"  + {_action(a)}" for a in actions.added]
    lines += [f"  - {_action(a)}" for a in actions.removed]
    for old, new in actions.changed:
        lines.append(
            f"  ~ run {old.run_id} {old.kind.value} at step {old.apply_at_step}: "
            f"{_params(old.params)} -> {_params(new.params)}"
        )
    for kind in NOTABLE:
        appear = [a for a in actions.added if a.kind.value == kind]
        vanish = [a for a in actions.removed if a.kind.value == kind]
        noun = "rollback" if kind == "rollback" else "LR restore"
        for a in appear:
            lines.append(f"a {noun} appears: run {a.run_id} at step {a.apply_at_step}")
        for a in vanish:
            lines.append(f"a {noun} vanishes: run {a.run_id} at step {a.apply_at_step}")
    if not (decisions or actions):
        lines.append("no differences")
    return lines
