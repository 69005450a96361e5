"""GradStats: the norms it reports, and host-side work that does not grow with the model."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from spikeguard.producers.stats import GradStats


class _TorchCalls(TorchFunctionMode):
    """Counts the torch functions and tensor methods called from Python (not attribute reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__qualname__", str(func))
        if not name.endswith("__get__"):  # p.grad and the like: reads, not operations
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _layers(n: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> nn.Module:
    torch.manual_seed(n)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(n)])
    for i, layer in enumerate(model):
        layer.to(dtypes[i % len(dtypes)])
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 10.0 ** (len(p.shape) - 2)
    return model


def _calls(model: nn.Module, **options) -> Counter[str]:
    stats = GradStats(list(model.named_parameters()), **options)
    update = [torch.randn_like(p) for p in model.parameters()]
    with _TorchCalls() as mode:
        stats.compute(torch.tensor(1.5), None, None, update)
    return mode.calls


def test_a_step_makes_as_many_torch_calls_for_40_parameters_as_for_4():
    # The per-parameter norms are one fused call; everything after works on the stacked norms,
    # so the host work per step does not grow with the number of parameters.
    assert _calls(_layers(20)) == _calls(_layers(2))


def test_norms_are_the_norms_of_the_per_parameter_norms_to_the_bit():
    # Mixed dtypes: each norm is widened to float32 (a double one rounded once), as before.
    model = _layers(6, (torch.float32, torch.bfloat16, torch.float64))
    params = list(model.parameters())
    update = [torch.randn_like(p) for p in params]
    stats, _ = GradStats(list(model.named_parameters()), top_k=3, param_norm=True).compute(
        torch.tensor(2.0), None, None, update
    )

    def norm(tensors: list[torch.Tensor]) -> float:
        each = torch._foreach_norm(tensors)
        return torch.linalg.vector_norm(torch.stack([t.float() for t in each])).item()

    grads = [p.grad for p in params]
    assert stats.grad_norm == norm(grads)  # type: ignore[arg-type]
    assert stats.param_norm == norm([p.detach() for p in params])
    assert stats.update_norm == norm(update)
    per_param = torch.stack([t.float() for t in torch._foreach_norm(grads)])  # type: ignore[arg-type]
    names = [name for name, _ in model.named_parameters()]
    values, index = torch.topk(per_param, 3)
    assert stats.top_grad_norms == {names[i]: v for i, v in zip(index.tolist(), values.tolist())}
    assert stats.loss == 2.0


def test_a_default_step_makes_ten_torch_calls_and_leaves_the_top_k_to_its_reader():
    # The default step (gradient and update norms, the top 5, no batch, no ranks): every call
    # costs a few microseconds of the training thread, so none that changes nothing (a
    # reshape, a float of a float, a move to the same device, a cast cat makes anyway).
    # It made 20 before, then 12, then 11. On the CPU the top 5 need no transfer: they are
    # picked where they are read (the publisher's thread), not by the training thread.
    calls = _calls(_layers(2))
    calls.pop("_VariableFunctionsClass.tensor")  # the test's own loss
    assert sum(calls.values()) <= 10, calls
    assert not any("topk" in name for name in calls), calls
    model = _layers(3)
    stats, _ = GradStats(list(model.named_parameters()), top_k=4).compute(torch.tensor(1.5))
    with _TorchCalls() as mode:
        top = stats.top_grad_norms
    assert any("topk" in name for name in mode.calls)
    with _TorchCalls() as again:
        assert stats.top_grad_norms is top  # picked once
    assert not again.calls
    grads = [p.grad for p in model.parameters()]
    per_param = torch.stack(list(torch._foreach_norm(grads)))  # type: ignore[arg-type]
    values, index = torch.topk(per_param, 4)
    names = [name for name, _ in model.named_parameters()]
    assert list(top.items()) == [(names[i], v) for i, v in zip(index.tolist(), values.tolist())]


def test_the_loss_in_any_dtype_or_as_a_number_comes_back_as_its_float32_value():
    model = _layers(2)
    stats = GradStats(list(model.named_parameters()))
    for loss, expected in [
        (torch.tensor(1.1, dtype=torch.float64), torch.tensor(1.1).item()),
        (torch.tensor(1.3, dtype=torch.bfloat16), torch.tensor(1.3, dtype=torch.bfloat16).item()),
        (torch.tensor([[2.5]], requires_grad=True) * 1, 2.5),
        (0.1, torch.tensor(0.1).item()),
    ]:
        assert stats.compute(loss)[0].loss == expected
