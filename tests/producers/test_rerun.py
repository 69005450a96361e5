"""Re-running a suspicious step: a one-off fault is transient, a poisoned batch reproducible."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from spikeguard.producers.rerun import RerunCheck  # noqa: E402


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                torch.nn.Linear(16, 1))
    x, y = torch.randn(32, 6), torch.randn(32, 1)
    return model, x, y


def _first_run(model, x, y, check, corrupt=None):
    check.before_step()
    inputs = corrupt(x) if corrupt else x
    loss = torch.nn.functional.mse_loss(model(inputs), y)
    loss.backward()
    norm = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])))
    return float(loss), norm


def test_a_fault_only_on_the_first_run_is_transient_and_the_rerun_gradients_are_clean():
    model, x, y = _setup()
    check = RerunCheck(1)
    loss, norm = _first_run(model, x, y, check, corrupt=lambda t: t * 1e4)  # a flipped exponent, once
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
    assert check.verify(lambda: _backward(model, poisoned, y), list(model.parameters()), loss, norm) \
        == "reproducible"
    # An extreme but finite batch: dropout draws the same masks on the rerun, so it agrees too.
    model, x, y = _setup()
    loss, norm = _first_run(model, x * 1e3, y, check)
    assert check.verify(lambda: _backward(model, x * 1e3, y), list(model.parameters()), loss, norm) \
        == "reproducible"


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
    assert check.verify(lambda: _backward(model, x, y), list(model.parameters()), loss, norm) is None
    with pytest.raises(ValueError, match="verify_reruns must be 0"):
        RerunCheck(3)


def _backward(model, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss
