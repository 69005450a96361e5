"""The guard's memory of what it has done, which no rollback may undo.

Every action id is applied once. The set of applied ids travels inside every
checkpoint, and — so that a crash between two checkpoints cannot make a
restarted trainer apply an action twice — also in a small sidecar file in the
checkpoint directory, rewritten atomically after every step that resolved an
action. The sidecar carries the other facts a restart must not forget: the
rollback epoch, the data ranges to skip, and the settings actions changed.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from spikeguard.producers.atomic import atomic_write_bytes
from spikeguard.producers.io_faults import IOFaults, IOKind, describe

log = logging.getLogger("spikeguard.producers.guard")

SIDECAR = "spikeguard-ledger.json"


class ActionLedger:
    def __init__(
        self,
        path: str | os.PathLike | None = None,
        max_ids: int = 10_000,
        faults: IOFaults | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.max_ids = max_ids
        self.faults = faults if faults is not None else IOFaults()
        self._applied: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, action_id: str) -> bool:
        return action_id in self._applied

    def __len__(self) -> int:
        return len(self._applied)

    def record(self, action_id: str) -> None:
        self._applied[action_id] = None
        self._applied.move_to_end(action_id)
        while len(self._applied) > self.max_ids:  # bounded: forget the oldest
            self._applied.popitem(last=False)

    def state_dict(self) -> dict[str, Any]:
        return {"applied": list(self._applied)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Merge (never replace): what was applied stays applied."""
        for action_id in state.get("applied", ()):
            if action_id not in self._applied:
                self.record(action_id)

    def persist(self, extra: dict[str, Any]) -> bool:
        """Rewrite the sidecar; False when the write failed (reported by ``faults``, not raised:
        the ids stay in memory and go into the next checkpoint)."""
        if self.path is None:
            return True
        data = json.dumps(dict(extra, applied=list(self._applied)), default=_json_default).encode()
        path = self.path
        return self.faults.attempt(IOKind.LEDGER, lambda: atomic_write_bytes(path, data))

    def read(self) -> dict[str, Any] | None:
        """The sidecar's content (and its ids merged in), or None when there is none or it is
        unreadable (said in a WARNING: the checkpoint's own ids still apply)."""
        if self.path is None or not self.path.exists():
            return None
        try:
            body = json.loads(self.path.read_text())
            if not isinstance(body, dict):
                raise ValueError(f"a JSON {type(body).__name__}, not an object")
            self.load_state_dict(body)
        except (OSError, ValueError, TypeError) as exc:
            log.warning(
                "spikeguard: the action ledger %s is unreadable (%s); going on with the ids "
                "and facts of the checkpoint (an action applied after it could apply again)",
                self.path,
                describe(exc),
            )
            return None
        return body


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):  # pragma: no cover - json allows it
        return value
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def restart_facts(
    run_id: str, epoch: int, step: int, position: Any, lr: Any, clipper: Any
) -> dict[str, Any]:
    """What the sidecar keeps beside the ids: what a restart must not forget since the
    last checkpoint (the epoch, the data to skip, the settings actions changed)."""
    return {
        "run_id": run_id,
        "epoch": epoch,
        "step": step,
        "skip_ranges": position.skip_ranges,
        "settings": {"lr_scale": lr.scale, "clip": clipper.settings()},
    }


def apply_restart_facts(side: dict[str, Any], position: Any, lr: Any, clipper: Any) -> int:
    """Put the sidecar's facts over a checkpoint just loaded; returns the sidecar's epoch."""
    if side.get("skip_ranges"):
        position.load_state_dict(dict(position.state_dict(), skip_ranges=side["skip_ranges"]))
    settings = side.get("settings", {})
    if "lr_scale" in settings:
        lr.scale = float(settings["lr_scale"])
    for name in ("max_norm", "z"):  # the settings actions changed since that checkpoint
        if name in settings.get("clip", {}):
            setattr(clipper, name, settings["clip"][name])
    return int(side.get("epoch", 0))
