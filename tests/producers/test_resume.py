"""Resume says what it does, and a finished run is never resumed."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from producers_helpers import Tiny, train
from spikeguard.producers import Guard, GuardConfig


def _guard(
    tiny: Tiny, tmp_path, *, run_id: str = "my-run", embedded: bool = False, **config
) -> Guard:
    """``embedded``: on the Guard's own embedded pipeline (else no bus at all)."""
    cfg = dict(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=10, resume=True)
    return Guard(
        tiny.model,
        tiny.optimizer,
        run_id=run_id,
        config=GuardConfig(**{**cfg, **config}),
        **({} if embedded else {"bus": None}),
    )


def _readme_example(tmp_path, steps: int = 25) -> Guard:
    """The README's loop: wrap the loader, step, close — nothing else."""
    tiny = Tiny(seed=1)
    guard = _guard(tiny, tmp_path)
    for batch in guard.data(tiny.loader, max_steps=steps):
        guard.step(tiny.loss(batch))
    guard.close()
    return guard


@pytest.mark.pipeline
def test_running_the_readme_example_twice_trains_both_times(tmp_path, caplog):
    first = _readme_example(tmp_path)
    assert first.counters["updates"] == 25
    with caplog.at_level(logging.WARNING, logger="spikeguard.producers.guard"):
        second = _readme_example(tmp_path)
    assert second.resumed_from is None
    assert second.counters["updates"] == 25  # was 0: the finished run was silently resumed
    said = [
        r for r in caplog.records if r.levelno == logging.WARNING and "finished" in r.getMessage()
    ]
    assert len(said) == 1 and "my-run" in said[0].getMessage()
    # The finished run's files were moved aside, not deleted, and the message says where.
    archived = [
        p for p in (tmp_path / "ckpt").iterdir() if p.is_dir() and p.name.startswith("finished-")
    ]
    assert len(archived) == 1 and str(archived[0]) in said[0].getMessage()
    assert any(p.name.endswith(".pt") for p in archived[0].iterdir())


def test_an_interrupted_run_resumes_and_says_so_in_one_warning_line(tmp_path, caplog):
    tiny = Tiny(seed=1)
    guard = _guard(tiny, tmp_path)
    train(guard, tiny, 25)  # planned 25, but the process dies before close(): not finished
    guard.saver.wait()
    weights = [p.detach().clone() for p in tiny.model.parameters()]
    del guard

    again = Tiny(seed=2)
    with caplog.at_level(logging.WARNING, logger="spikeguard.producers.guard"):
        resumed = _guard(again, tmp_path)
    assert resumed.resumed_from is not None and resumed.step_count == 20
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "resum" in r.getMessage()
    ]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "resum" in lines[0] and "my-run" in lines[0] and "step 20" in lines[0]
    assert str(tmp_path / "ckpt") in lines[0] and "resume='never'" in lines[0]  # how to opt out
    assert not all(torch.equal(a, b) for a, b in zip(weights, again.model.parameters()))


@pytest.mark.pipeline
def test_a_run_stopped_early_is_not_finished_and_resumes(tmp_path):
    tiny = Tiny(seed=1)
    guard = _guard(tiny, tmp_path)
    for batch in guard.data(tiny.loader, max_steps=40):
        guard.step(tiny.loss(batch))
        if guard.step_count == 22:
            break  # the user's own loop ended before the planned steps
    guard.close()
    resumed = _guard(Tiny(seed=1), tmp_path)
    assert resumed.resumed_from is not None and resumed.resumed_from.step == 20


@pytest.mark.pipeline
def test_a_final_checkpoint_marks_the_run_finished(tmp_path):
    tiny = Tiny(seed=1)
    guard = _guard(tiny, tmp_path)
    data = guard.data(tiny.loader)
    for i, batch in enumerate(data):
        guard.step(tiny.loss(batch))
        if i == 11:
            break
    event = guard.checkpoint("final")
    assert event.reason == "final" and event.step == 12
    guard.close()
    fresh = _guard(Tiny(seed=1), tmp_path)
    assert fresh.resumed_from is None and fresh.step_count == 0


@pytest.mark.pipeline
def test_a_loop_that_ran_out_of_data_is_finished(tmp_path):
    tiny = Tiny(seed=1)
    guard = _guard(tiny, tmp_path)
    for batch in guard.data(tiny.loader):  # one pass over the data: 64 batches
        guard.step(tiny.loss(batch))
    guard.close()
    assert guard.finished
    assert _guard(Tiny(seed=1), tmp_path).resumed_from is None


def test_a_new_run_id_in_a_directory_holding_another_runs_checkpoints_is_refused(tmp_path):
    """Two runs, one explicit checkpoint_dir: the second (a fresh model, another run_id) used to
    resume the first's weights from its unfinished checkpoint, and its rotation would delete the
    first's files. Refused at the start, naming both runs and the way out; the first's files
    stay where they were."""
    from spikeguard.errors import ConfigError

    tiny = Tiny(seed=1)
    first = _guard(tiny, tmp_path)
    train(first, tiny, 25)  # not closed: an unfinished run, resumable
    first.saver.wait()
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    other = Tiny(seed=2)
    threads = set(threading.enumerate())
    with pytest.raises(ConfigError) as refused:
        # (on its own embedded pipeline: what it started is stopped again)
        _guard(other, tmp_path, run_id="another-run", embedded=True)
    left = [t.name for t in set(threading.enumerate()) - threads if t.is_alive()]
    assert not left, left
    said = str(refused.value)
    assert "my-run" in said and "another-run" in said and "checkpoint_dir" in said, said
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == files
    # The first run itself still resumes there.
    again = _guard(Tiny(seed=1), tmp_path)
    assert again.resumed_from is not None and again.resumed_from.step == 20
    again.close()


def test_a_finished_run_moved_aside_for_another_run_id_is_named_for_what_it_is(tmp_path, caplog):
    _readme_example(tmp_path)  # "my-run", finished
    tiny = Tiny(seed=2)
    with caplog.at_level(logging.WARNING, logger="spikeguard.producers.guard"):
        guard = _guard(tiny, tmp_path, run_id="another-run")
    guard.close()
    said = [r.getMessage() for r in caplog.records if "finished" in r.getMessage()]
    assert len(said) == 1 and "run my-run already finished" in said[0], said
