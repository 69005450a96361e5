"""The guard's state and its recovery: rollback, skipping data, resuming after a restart.

A mixin of :class:`~spikeguard.producers.guard.Guard`, kept apart so that each
file holds one idea: this one is about what the guard remembers and how it
puts a run back — and what it never forgets (applied action ids, skip
ranges, the rollback epoch).
"""

from __future__ import annotations

import logging
from typing import Any

from spikeguard.producers import snapshot
from spikeguard.producers.actions import ActionFailed
from spikeguard.producers.data import merge_ranges

log = logging.getLogger(__name__)


class RecoveryMixin:
    """Needs the Guard's attributes: store, ledger, lr, clipper, health, loader, counters, ..."""

    def rollback(self, target_step: int, checkpoint_id: str | None = None) -> str:
        info = self.store.find(checkpoint_id) if checkpoint_id else None
        note = ""
        if info is None or info.step > target_step:
            info = self.store.newest_healthy(max_step=target_step)
            note = f" (checkpoint {checkpoint_id} not found; newest healthy at or before {target_step})"
        if info is None:
            raise ActionFailed(f"no checkpoint at or before step {target_step} to roll back to")
        snapshot.restore(self, self.store.load(info))
        self.epoch += 1
        self.step_count = info.step
        self.should_stop = False
        self._old_history = dict(self._history)
        for s in [s for s in self._history if s >= info.step]:
            del self._history[s]
        self.counters["rollbacks"] += 1
        return f"rolled back to step {info.step} ({info.checkpoint_id}), now epoch {self.epoch}{note}"

    def skip_steps(self, from_step: int, to_step: int, extra: int = 0, after_rollback: bool = False) -> str:
        if to_step < from_step or extra < 0:
            raise ActionFailed(f"bad skip window {from_step}..{to_step} (+{extra})")
        first, second = (self._old_history, self._history) if after_rollback else (self._history, self._old_history)
        known = [first.get(s, second.get(s)) for s in range(from_step, to_step + 1)]
        known = [k for k in known if k is not None]
        if not known:
            raise ActionFailed(f"no batch index known for steps {from_step}..{to_step}")
        start, end = min(known), max(known) + extra
        if self.loader is not None:
            self.loader.skip(start, end)
        else:
            state = self._data_state or {"position": 0}
            state["skip_ranges"] = merge_ranges(list(state.get("skip_ranges", [])) + [[start, end]])
            self._data_state = state
        return f"skipping batches {start}..{end}"

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_count, "epoch": self.epoch, "lr": self.lr.state_dict(),
                "clip": self.clipper.state_dict(), "health": self.health.state_dict(),
                "ledger": self.ledger.state_dict(), "data_seed": self.data_seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt a checkpoint's guard state; the applied-action ids are merged, not replaced."""
        self.lr.load_state_dict(state.get("lr", {}))
        self.clipper.load_state_dict(state.get("clip", {}))
        self.health.load_state_dict(state.get("health", {}))
        self.ledger.load_state_dict(state.get("ledger", {}))

    def data_state(self) -> dict[str, Any]:
        if self.loader is not None:
            return self.loader.state_dict()
        return dict(self._data_state or {"position": 0, "skip_ranges": []})

    def set_data_state(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        if self.loader is not None:
            self.loader.load_state_dict(state)  # position from the checkpoint, skip ranges merged
        else:
            skips = list((self._data_state or {}).get("skip_ranges", []))
            self._data_state = dict(state, skip_ranges=merge_ranges(skips + list(state.get("skip_ranges", []))))

    def resume(self) -> Any:
        """Continue from the newest checkpoint of this run, if any (the ledger always applies)."""
        side = self.ledger.read() or {}
        info = self.store.newest()
        if info is not None:
            body = self.store.load(info)
            snapshot.restore(self, body)
            self.step_count, self.epoch = info.step, info.epoch
            self.resumed_from = info
            self._started = True
            log.info("spikeguard: resumed %s from step %d (%s)", self.run_id, info.step, info.path)
        self.epoch = max(self.epoch, int(side.get("epoch", 0)))
        if side.get("skip_ranges"):
            self.set_data_state(dict(self.data_state(), skip_ranges=side["skip_ranges"]))
        settings = side.get("settings", {})
        if "lr_scale" in settings:
            self.lr.scale = float(settings["lr_scale"])
        for name in ("max_norm", "z"):
            if name in settings.get("clip", {}):
                setattr(self.clipper, name, settings["clip"][name])
        return info

    def _persist_ledger(self) -> None:
        if self.rank != 0:
            return
        self.ledger.persist({"run_id": self.run_id, "epoch": self.epoch, "step": self.step_count,
                             "skip_ranges": self.data_state().get("skip_ranges", []),
                             "settings": {"lr_scale": self.lr.scale, "clip": self.clipper.settings()}})

