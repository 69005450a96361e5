"""Re-running a suspicious step: a one-off fault is transient, a poisoned batch reproducible."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from spikeguard.producers.rerun import RerunCheck  # noqa: E402


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
    )
    x, y = torch.randn(32, 6), torch.randn(32, 1)
    return model, x, y


def _first_run(model, x, y, check, corrupt=None):
    check.before_step()
    inputs = corrupt(x) if corrupt else x
    loss = torch.nn.functional.mse_loss(model(inputs), y)
    loss.backward()
    norm = float(
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    )
    return float(loss), norm


def test_a_fault_only_on_the_first_run_is_transient_and_the_rerun_gradients_are_clean():
    model, x, y = _setup()
    check = RerunCheck(1)
    loss, norm = _first_run(
        model, x, y, check, corrupt=lambda t: t * 1e4
    )  # a flipped exponent, once
    closure = lambda: _backward(model, x, y)  # noqa: E731  the second run sees the true batch
    assert check.verify(closure, list(model.parameters()), loss, norm) == "transient"
    assert check.counts == {"transient": 1, "reproducible": 0}
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_poisoned_batch_is_reproducible_even_with_dropout():
    model, x, y = _setup()
    poisoned = x.clone()
    poisoned[3] = float("nan")
    check = RerunCheck(1)
    loss, norm = _first_run(model, poisoned, y, check)
    assert (
        check.verify(lambda: _backward(model, poisoned, y), list(model.parameters()), loss, norm)
        == "reproducible"
    )
    # An extreme but finite batch: dropout draws the same masks on the rerun, so it agrees too.
    model, x, y = _setup()
    loss, norm = _first_run(model, x * 1e3, y, check)
    assert (
        check.verify(lambda: _backward(model, x * 1e3, y), list(model.parameters()), loss, norm)
        == "reproducible"
    )


def test_the_rerun_leaves_the_random_streams_as_one_run_would():
    model, x, y = _setup()
    check = RerunCheck(1)
    loss, norm = _first_run(model, x, y, check)
    expected = torch.get_rng_state()
    check.verify(lambda: _backward(model, x, y), list(model.parameters()), loss, norm)
    assert torch.equal(torch.get_rng_state(), expected)


def test_off_by_default_and_only_zero_or_one():
    model, x, y = _setup()
    check = RerunCheck()
    loss, norm = _first_run(model, x, y, check)
    assert (
        check.verify(lambda: _backward(model, x, y), list(model.parameters()), loss, norm) is None
    )
    with pytest.raises(ValueError, match="verify_reruns must be 0"):
        RerunCheck(3)


def _backward(model, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss


# -- the Guard's use: a transient fault's re-run is the step's true update ----------------------

FAULT_STEP = 80  # past the skip rule's warm-up, so that an extreme gradient is judged an outlier


def _corrupt(model, how: str | None) -> None:
    if how is None:
        return
    for p in model.parameters():
        p.grad.mul_(float("nan") if how == "nan" else 1e4)


def _guarded(tmp_path, first: str | None = None, rerun: str | None = None, steps: int = 100):
    """A real model trained ``steps`` steps under a Guard with verify_reruns=1; at FAULT_STEP the
    first computation's gradient is corrupted as ``first`` says and the re-run's as ``rerun``."""
    from producers_helpers import Tiny

    from spikeguard.producers import Guard, GuardConfig

    tiny = Tiny()
    cfg = GuardConfig(
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=0,
        resume=False,
        verify_reruns=1,
        data_seed=0,
    )
    guard = Guard(tiny.model, tiny.optimizer, run_id="rerun", connect=False, config=cfg)
    before_fault = None
    for batch in guard.data(tiny.loader, max_steps=steps):
        step = guard.step_count

        def closure(batch=batch, step=step):
            loss = tiny.loss(batch)
            _corrupt(tiny.model, rerun if step == FAULT_STEP else None)
            return loss

        loss = tiny.loss(batch)
        _corrupt(tiny.model, first if step == FAULT_STEP else None)
        if step == FAULT_STEP:
            before_fault = tiny.params()
        guard.step(loss, closure=closure)
        if step == FAULT_STEP:
            after_fault = tiny.params()
    guard.close()
    return guard, tiny.params(), before_fault, after_fault


@pytest.mark.parametrize("first", ["nan", "extreme"])
def test_a_transient_fault_applies_the_clean_rerun_and_the_weights_equal_the_clean_run(
    tmp_path, first
):
    _, clean, _, _ = _guarded(tmp_path / "clean")
    guard, faulty, _, _ = _guarded(tmp_path / "faulty", first=first)
    assert guard.rerun.counts == {"transient": 1, "reproducible": 0}
    assert guard.counters["transient_steps"] == 1
    assert guard.counters["skipped_updates"] == 0 and guard.counters["updates"] == 100
    assert all(torch.equal(a, b) for a, b in zip(clean, faulty))


@pytest.mark.parametrize("first,rerun", [("nan", "extreme"), ("extreme", "nan")])
def test_a_rerun_that_is_itself_suspicious_keeps_the_skip(tmp_path, first, rerun):
    guard, _, before, after = _guarded(tmp_path, first=first, rerun=rerun)
    assert guard.rerun.counts == {"transient": 1, "reproducible": 0}
    assert guard.counters["transient_steps"] == 1 and guard.counters["skipped_updates"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the fault step changed nothing
