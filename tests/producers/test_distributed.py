"""Two CPU ranks on gloo: every action at the same step on both, identical parameters."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import disagreement_worker
import distributed_worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path, *extra) -> None:
    for attempt in range(2):
        try:
            mp.spawn(
                distributed_worker.run_all,
                args=(2, _free_port(), str(tmp_path), *extra),
                nprocs=2,
                join=True,
            )
            return
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            ranks = "\n".join(
                f"--- rank{r}.err:\n{_text(tmp_path / f'rank{r}.err')}" for r in (0, 1)
            )
            # The free port can be taken by another process between the probe and the bind.
            if attempt or not any(
                w in f"{exc}{ranks}" for w in ("Address already in use", "EADDRINUSE")
            ):
                raise AssertionError(f"a rank failed: {exc}\n{ranks}") from exc


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else "(none)"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, str | None]:
    """Every two-rank run of this module in one spawn of two processes (distributed_worker.run_all):
    where each left its results, and why the spawn failed, if it did (a rank that died still left
    the runs it finished)."""
    out = tmp_path_factory.mktemp("ranks")
    scenarios = list(disagreement_worker.SCENARIOS)
    try:
        _spawn(out, [_free_port(), _free_port()], scenarios)
    except AssertionError as exc:
        return out, str(exc)
    return out, None


def _both(ranks: tuple[Path, str | None], run: str) -> tuple[dict, dict]:
    out, failure = ranks
    found = [out / run / f"rank{r}.json" for r in (0, 1)]
    if not all(p.exists() for p in found):
        raise AssertionError(f"the {run} run left no result: {failure}")
    r0, r1 = (json.loads(p.read_text()) for p in found)
    return r0, r1


def test_two_ranks_apply_the_same_actions_at_the_same_steps(ranks):
    r0, r1 = _both(ranks, "actions")
    assert r0["applied"] == r1["applied"]
    kinds = [(step, kind, status) for step, _, kind, status in r0["applied"]]
    assert kinds == [
        (3, "scale_lr", "applied"),
        (5, "clip", "applied"),
        (14, "rollback", "applied"),
        (10, "skip_batches", "applied"),
    ]
    assert r0["params"] == r1["params"]  # identical parameters on both ranks
    assert r0["epoch"] == r1["epoch"] == 1
    assert r0["skipped"] == r1["skipped"] == 1  # rank 1's NaN made both ranks skip step 7
    assert r0["skip_ranges"] == r1["skip_ranges"] == [[10, 14]]
    assert r0["acks"] == ["applied"] * 4


def test_an_outlier_on_one_rank_is_skipped_on_every_rank_at_the_same_step(ranks):
    r0, r1 = _both(ranks, "outlier")
    assert r0["outcomes"] == r1["outcomes"]
    assert [i for i, applied in enumerate(r0["outcomes"]) if not applied] == [
        distributed_worker.OUTLIER_AT
    ]
    assert r0["outlier_skips"] == r1["outlier_skips"] == 1
    assert r0["params"] == r1["params"]


# -- ranks in disagreement: each scenario once, in the module's one spawn (disagreement_worker.py)
@pytest.fixture(scope="module")
def disagreement(ranks):
    out, failure = ranks
    out = out / "disagree"

    def result(name: str) -> tuple[dict, dict]:
        found = [out / f"rank{r}-{name}.json" for r in (0, 1)]
        if not all(p.exists() for p in found):
            raise AssertionError(f"scenario {name} left no result: {failure}")
        r0, r1 = (json.loads(p.read_text()) for p in found)
        for r in (r0, r1):
            assert "error" not in r, r["error"]
        assert r0["hash"] == r1["hash"]  # the same parameters and optimizer state on both ranks
        return r0, r1

    return result


def test_a_rollback_to_the_checkpoint_just_queued_lands_every_rank_on_it(disagreement):
    r0, r1 = disagreement("race")
    assert r0["landed"] == r1["landed"] == 10
    assert r0["rollback"] == r1["rollback"] and r0["rollback"].startswith("rolled back to step 10")


def test_one_ranks_read_error_in_a_rollback_gives_every_rank_the_same_outcome_ddp(disagreement):
    _agreed_after_read_error(*disagreement("read_error"))


def test_one_ranks_read_error_in_a_rollback_gives_every_rank_the_same_outcome_fsdp2(disagreement):
    _agreed_after_read_error(*disagreement("fsdp_read_error"))


def _agreed_after_read_error(r0: dict, r1: dict) -> None:
    assert r1["injected"]  # the error did happen, on rank 1 only
    assert r0["applied"] == r1["applied"]
    step, epoch, kind, status, result = r0["applied"][0]
    assert (step, epoch, kind, status) == (12, 1, "rollback", "applied")  # (acked in its new epoch)
    # rank 1 could not read the checkpoint at 10: every rank took the next older one
    assert result.startswith("rolled back to step 5") and "rank 1" in result
    assert r0["acks"] == [["applied", result]]
    assert r0["epoch"] == r1["epoch"] == 1 and r0["rollbacks"] == r1["rollbacks"] == 1


def test_a_spike_on_one_ranks_data_is_published_and_judged_as_the_runs(disagreement):
    from spikeguard.lab.backtest import backtest_events
    from spikeguard.schemas import StepEvent

    r0, r1 = disagreement("spike")
    events = [StepEvent.model_validate(e) for e in r0["events"]]
    assert len(events) == 56
    for e in events:
        key = f"{e.epoch}/{e.step}"
        local = (r0["losses"][key], r1["losses"][key])
        assert e.loss == pytest.approx(max(local), rel=1e-6), key
        assert e.loss_mean == pytest.approx(sum(local) / 2, rel=1e-6), key
        assert e.loss_ranks == 2
    healthy = sorted(e.loss for e in events if 20 <= e.step < 40)
    first = disagreement_worker.SPIKE[0]
    assert (
        events[first].loss > 1000 * healthy[len(healthy) // 2]
    )  # rank 1's batch, in rank 0's event
    # The whole pipeline, on what rank 0 published, calls it a loss spike at its first step.
    decisions = {d.step: d for d in backtest_events(events) if d.is_anomaly}
    assert first in decisions, sorted(decisions)
    assert (
        decisions[first].type.value == "extreme_loss"
        and decisions[first].urgency.value == "critical"
    ), decisions[first]


def test_a_late_rank_keeps_its_own_state_at_every_checkpoint(disagreement):
    r0, r1 = disagreement("late")
    assert r0["ids"]["0"] == r0["ids"]["1"] and len(r0["ids"]["0"]) >= 3  # a companion for each
    assert r0["counted"] == r1["counted"]
    assert r0["rollback"] == r1["rollback"] and r0["rollback"].startswith("rolled back to step 0")
    assert r0["rng"] != r1["rng"]  # rank 1 got its own random streams back, not rank 0's


def test_a_rollback_falls_back_past_corrupt_checkpoints_on_every_rank(disagreement):
    r0, r1 = disagreement("truncated")
    assert r0["kept"] == [5, 10, 15]
    assert r0["landed"] == r1["landed"] == 5
    assert r0["rollback"] == r1["rollback"]
    assert "10" in r0["rollback"] and "15" in r0["rollback"]  # says which ones it passed over


# -- issue 37, rows 9-11: ranks agree on every outcome ----------------------------------------------
def _same_outcome(r0: dict, r1: dict) -> tuple:
    """Both ranks ended alike (the fixture checked the state hashes): the rollback's outcome."""
    assert r0["applied"] == r1["applied"]
    assert (r0["epoch"], r0["rollbacks"], r0["step"]) == (r1["epoch"], r1["rollbacks"], r1["step"])
    rollback = [a for a in r0["applied"] if a[2] == "rollback"]
    assert len(rollback) == 1, r0["applied"]
    return tuple(rollback[0])


def test_a_listing_error_on_rank_0_in_a_rollback_gives_every_rank_one_outcome(disagreement):
    r0, r1 = disagreement("list_error_rank0")
    assert r0["injected"] == ["list"] and not r1["injected"]
    step, epoch, kind, status, result = _same_outcome(r0, r1)
    # rank 0 could not weigh the plan: every rank withholds it, saying why
    assert status == "rejected" and "could not be weighed" in result and "OSError" in result


def test_a_listing_error_on_rank_1_in_a_rollback_falls_back_on_every_rank(disagreement):
    r0, r1 = disagreement("list_error_rank1")
    assert r1["injected"] == ["list"] and not r0["injected"]
    step, epoch, kind, status, result = _same_outcome(r0, r1)
    assert status == "applied" and result.startswith("rolled back to step 5"), result
    assert "rank 1: OSError" in result


def test_a_store_read_error_outside_torch_load_falls_back_on_every_rank_ddp(disagreement):
    _fell_back_after_load_error(*disagreement("load_error"))


def test_a_store_read_error_outside_torch_load_falls_back_on_every_rank_fsdp2(disagreement):
    _fell_back_after_load_error(*disagreement("fsdp_load_error"))


def _fell_back_after_load_error(r0: dict, r1: dict) -> None:
    assert r1["injected"] == ["load"] and not r0["injected"]
    step, epoch, kind, status, result = _same_outcome(r0, r1)
    assert status == "applied" and result.startswith("rolled back to step 5"), result
    assert "rank 1: OSError" in result and r0["epoch"] == 1


def test_the_budget_weighs_the_length_every_rank_agrees_on(disagreement):
    r0, r1 = disagreement("budget_lengths")
    step, epoch, kind, status, result = _same_outcome(r0, r1)
    # rank 1's loader is the shorter: 16 planned steps, 1 re-run allowed; the rollback asks 2
    assert status == "rejected" and "re-run 2 steps" in result and "of 16 planned" in result
    assert r0["epoch"] == r1["epoch"] == 0


def test_the_budget_weighs_the_plan_only_rank_0_holds_whole_on_every_rank(disagreement):
    r0, r1 = disagreement("budget_pending")
    step, epoch, kind, status, result = _same_outcome(r0, r1)
    # its skip window, due later, is over the skip budget: the rollback is withheld with it
    assert status == "rejected" and "skip the data of 22 steps" in result, result
    assert r0["epoch"] == r1["epoch"] == 0
