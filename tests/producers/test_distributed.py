"""Two CPU ranks on gloo: every action at the same step on both, identical parameters."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import distributed_worker  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path, *extra) -> None:
    for attempt in range(2):
        try:
            mp.spawn(distributed_worker.run, args=(2, _free_port(), str(tmp_path), *extra), nprocs=2,
                     join=True)
            return
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            ranks = "\n".join(f"--- rank{r}.err:\n{_text(tmp_path / f'rank{r}.err')}" for r in (0, 1))
            # The free port can be taken by another process between the probe and the bind.
            if attempt or not any(w in f"{exc}{ranks}" for w in ("Address already in use", "EADDRINUSE")):
                raise AssertionError(f"a rank failed: {exc}\n{ranks}") from exc


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else "(none)"


def test_two_ranks_apply_the_same_actions_at_the_same_steps(tmp_path):
    _spawn(tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["applied"] == r1["applied"]
    kinds = [(step, kind, status) for step, _, kind, status in r0["applied"]]
    assert kinds == [(3, "scale_lr", "applied"), (5, "clip", "applied"), (14, "rollback", "applied"),
                     (10, "skip_batches", "applied")]
    assert r0["params"] == r1["params"]  # identical parameters on both ranks
    assert r0["epoch"] == r1["epoch"] == 1
    assert r0["skipped"] == r1["skipped"] == 1  # rank 1's NaN made both ranks skip step 7
    assert r0["skip_ranges"] == r1["skip_ranges"] == [[10, 14]]
    assert r0["acks"] == ["applied"] * 4


def test_an_outlier_on_one_rank_is_skipped_on_every_rank_at_the_same_step(tmp_path):
    _spawn(tmp_path, 20)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["outcomes"] == r1["outcomes"]
    assert [i for i, applied in enumerate(r0["outcomes"]) if not applied] == [20]
    assert r0["outlier_skips"] == r1["outlier_skips"] == 1
    assert r0["params"] == r1["params"]
