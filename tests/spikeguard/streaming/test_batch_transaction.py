"""One batch transaction for the worker and the offline pump (streaming/batch_transaction.py).

A real fusion that fails on one poisoned verdict after taking it in: the batch is
rewound and retried record by record, the failing record is reported by its index
and leaves no trace, and the result is that of a stage that never saw it. The
worker and the offline pump both go through this one function.
"""

from __future__ import annotations

import json

import pytest

from spikeguard.processors.fusion import Fusion
from spikeguard.processors.fusion_stage import FusionStage
from spikeguard.streaming import batch_transaction
from spikeguard.streaming.batch_transaction import handle_batch
from .test_batch_undo import TOPICS, Faulty, first_batch, second_batch, comparable


def stage_of(fusion: type[Fusion]) -> FusionStage:
    return FusionStage(TOPICS, lambda run_id, config=None: fusion(config, run_id=run_id))


def items(verdicts: list) -> list:
    return [(TOPICS.verdicts, v) for v in verdicts]


def test_a_failing_record_is_reported_by_index_and_the_rest_is_as_if_it_never_came() -> None:
    stage, clean = stage_of(Faulty), stage_of(Fusion)
    failures: list[tuple[int, str]] = []
    for s in (stage, clean):
        assert handle_batch(
            s, items(first_batch()), lambda i, exc: pytest.fail(f"record {i}: {exc}")
        )
    poisoned = second_batch(with_poison=True)
    out = handle_batch(stage, items(poisoned), lambda i, exc: failures.append((i, str(exc))))
    expected = handle_batch(
        clean, items(second_batch(with_poison=False)), lambda i, exc: pytest.fail(str(exc))
    )

    poison_at = next(i for i, v in enumerate(poisoned) if v.signals.get("poison"))
    assert failures == [(poison_at, "fault at run b step 4")]
    assert [e.model_dump_json() for _, e in out] == [e.model_dump_json() for _, e in expected]
    assert len(out) == 2  # step 3 of runs a and b
    for run_id in "abc":
        assert comparable(stage.runs[run_id].state_dict()) == comparable(
            clean.runs[run_id].state_dict()
        )


def test_a_run_the_failing_record_would_have_created_is_dropped() -> None:
    stage = stage_of(Faulty)
    poisoned = [
        v.model_copy(update={"run_id": "new"})
        for v in second_batch(with_poison=True)
        if v.signals.get("poison")
    ]
    failures: list[int] = []
    assert handle_batch(stage, items(poisoned), lambda i, exc: failures.append(i)) == []
    assert failures == [0]
    assert "new" not in stage.runs
    assert json.dumps(stage.snapshot(["new"])) == json.dumps({})


def test_the_worker_and_the_offline_pump_share_the_one_transaction() -> None:
    from spikeguard.lab import backtest_pump
    from spikeguard.streaming import worker

    assert worker.handle_batch is batch_transaction.handle_batch
    assert backtest_pump.handle_batch is batch_transaction.handle_batch
    assert not hasattr(worker.Worker, "_rewind") and not hasattr(backtest_pump, "_rewind")
