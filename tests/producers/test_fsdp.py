"""FSDP2 on two CPU ranks (gloo): the global gradient norm, DCP checkpoints, one decision.

``fully_shard`` works on CPU with gloo in this torch, so this is FSDP2, not
FSDP1: every parameter and gradient is a DTensor sharded on dim 0.
"""

from __future__ import annotations

import json
import math
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_worker

pytestmark = pytest.mark.slow  # two processes importing torch.distributed: ~40 s on 2 busy cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    for attempt in range(2):
        try:
            mp.spawn(fsdp_worker.run, args=(2, _free_port(), str(out)), nprocs=2, join=True)
            break
        except mp.ProcessRaisedException as exc:
            # The free port can be taken by another process between the probe and the bind.
            if attempt or not any(w in str(exc) for w in ("Address already in use", "EADDRINUSE")):
                raise
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_the_reported_grad_norm_is_the_unsharded_models_norm(ranks):
    _, results = ranks
    for r in results:
        finite = {k: v for k, v in r["published"].items() if v is not None and math.isfinite(v)}
        assert len(finite) >= 18  # every published step but the poisoned one
        for key, norm in finite.items():
            assert norm == pytest.approx(r["reference"][key], rel=1e-5), key
    assert results[0]["published"] == results[1]["published"]  # both ranks report the global norm
    assert not math.isfinite(results[0]["published"]["0/7"])  # rank 1's NaN is in rank 0's norm too


def test_the_reported_update_norm_is_the_unsharded_models_update(ranks):
    """Step s's event carries step s-1's update: its norm over the whole parameters, 0 after
    the skipped NaN step, none on the first step after the rollback."""
    _, results = ranks
    for r in results:
        published, reference = r["published_updates"], r["reference_updates"]
        assert (
            published["0/0"] is None and published["1/10"] is None
        )  # nothing, or a checkpoint, before
        assert published["0/8"] == 0.0  # step 7's update was skipped (rank 1's NaN)
        compared = 0
        for key, norm in published.items():
            epoch, step = map(int, key.split("/"))
            previous = f"{epoch}/{step - 1}"
            if norm is not None and previous in reference:
                assert norm == pytest.approx(reference[previous], rel=1e-5, abs=1e-9), key
                compared += 1
        assert compared >= 16
    assert results[0]["published_updates"] == results[1]["published_updates"]


def test_the_norm_is_reduced_across_shards_once_per_step(ranks):
    # (the parameter and update norms, on by default, ride in the same all-reduce)
    _, results = ranks
    for r in results:
        assert set(r["reduces"].values()) == {1}


def test_both_ranks_make_the_same_skip_decisions(ranks):
    _, (r0, r1) = ranks
    assert r0["outcomes"] == r1["outcomes"]
    assert [(e, s) for e, s, applied in r0["outcomes"] if not applied] == [
        (0, 7),
        (0, 14),
    ]  # NaN, rollback
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["skip_ranges"] == r1["skip_ranges"] == [[10, 14]]


def test_a_rollback_restores_every_ranks_shards_from_a_dcp_checkpoint(ranks):
    out, results = ranks
    for r in results:
        assert r["rollbacks"] == 1 and r["epoch"] == 1
        assert r["n_shards"] == 4 + 8 and all(
            r["restored"]
        )  # 4 parameters and their 2 Adam moments
    # Each rank holds its rows only: (16, 6), (16,), (1, 16), (1,) split on dim 0.
    assert [r["shard_rows"][:4] for r in results] == [[8, 8, 1, 1], [8, 8, 0, 0]]
    ckpt = out / "ckpt"
    for r in results:  # a restarted job's fresh model gets every rank's shards and moments back
        assert (
            r["resumed_at"] == [1, 20] and len(r["resumed_equal"]) == 12 and all(r["resumed_equal"])
        )
    files = sorted(p.name for p in ckpt.glob("ckpt-*.pt") if ".rank" not in p.name)
    assert files
    for name in files:
        body = torch.load(ckpt / name, weights_only=True)
        assert "model" not in body and "optimizer" not in body  # no rank-0 torch.save of a shard
        shards = Path(body["sharded"]["dcp"])
        assert sorted(p.name for p in (ckpt / shards.name).iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]  # every rank wrote its part


def test_an_fsdp1_model_is_refused_with_the_reason(tmp_path):
    """FSDP1's flat shards are plain tensors: their norm would be one rank's slice, and its
    state_dict a collective gather from the checkpoint thread. Refused, pointing to FSDP2."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    from spikeguard.errors import ConfigError
    from spikeguard.producers import Guard, GuardConfig

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.warns(
            UserWarning, match="NO_SHARD"
        ):  # (one rank: FSDP1 says it will not shard)
            model = FullyShardedDataParallel(torch.nn.Linear(4, 2), device_id=torch.device("cpu"))
        with pytest.raises(ConfigError, match="fully_shard"):
            Guard(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                run_id="f1",
                connect=False,
                config=GuardConfig(checkpoint_dir=str(tmp_path / "ckpt"), resume=False),
            )
    finally:
        dist.destroy_process_group()


def test_the_norms_reduction_has_one_entry_per_parameter_whatever_has_a_gradient(tmp_path):
    """The all-reduce of the sharded norms is as long on every rank: a parameter this rank did
    not use (no gradient) counts as zero, it does not shorten the vector (another rank that
    used it would reduce a longer one: gloo aborts on the mismatch, NCCL may hang)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from spikeguard.producers.stats import GradStats

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = _HalfUsed()
        fully_shard(model)
        stats = GradStats(list(model.named_parameters()))
        model(torch.randn(3, 4)).sum().backward()
        assert [p.grad is None for p in model.parameters()] == [False, False, True, True]
        reduced = fsdp_worker._count_sum_all_reduces()
        try:
            result, grads = stats.compute(torch.tensor(1.0))
        finally:
            dist.all_reduce = reduced.real
        assert reduced == [(4,)]  # every parameter, not the two with a gradient
        expected = torch.linalg.vector_norm(
            torch.stack([p.grad.full_tensor().norm() for p in model.used.parameters()])
        )
        assert result.grad_norm == pytest.approx(float(expected), rel=1e-6)
        assert len(grads) == 2 and set(result.top_grad_norms) <= {"used.weight", "used.bias"}
    finally:
        dist.destroy_process_group()


class _HalfUsed(torch.nn.Module):
    """A model one of whose layers this rank does not use (another rank might)."""

    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)
