"""``response_stats``: chunked statistics equal the unchunked float32 softmax, values and gradients, and
backward does not allocate a full-size gradient per chunk."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsrl.engines.forward import response_stats

TEMPERATURE = 0.8


def reference(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The unchunked computation: log-softmax of all the float32 logits at once."""
    log_softmax = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    return {
        "log_probs": log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1),
        "entropy": -(log_softmax.exp() * log_softmax).sum(-1),
        "sum_pi_squared": (2 * log_softmax).exp().sum(-1),
    }


# 3 x 5 = 15 positions: chunks of one position, pieces of a sequence (2 does not divide 5), one sequence,
# blocks of two sequences (the last block one), and all at once.
@pytest.mark.parametrize("chunk_rows", [1, 2, 5, 12, 15, None])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_stats_and_gradients_equal_the_unchunked_softmax(chunk_rows, entropy_grad):
    g = torch.Generator().manual_seed(0)
    model_logits = torch.randn(3, 6, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    weights = torch.randn(2, 3, 5, generator=g)
    logits = model_logits[:, :-1]  # as the actor passes them: a non-contiguous view
    stats = response_stats(
        logits,
        labels,
        temperature=TEMPERATURE,
        with_entropy=True,
        with_sum_pi_squared=True,
        entropy_grad=entropy_grad,
        chunk_rows=chunk_rows,
    )
    expected = reference(logits, labels)
    for name, value in expected.items():
        assert stats[name].dtype == torch.float32 and stats[name].shape == (3, 5)
        torch.testing.assert_close(stats[name], value.detach())
    assert stats["entropy"].requires_grad == entropy_grad and not stats["sum_pi_squared"].requires_grad

    objective = (weights[0] * stats["log_probs"]).sum()
    expected_objective = (weights[0] * expected["log_probs"]).sum()
    if entropy_grad:
        objective = objective + (weights[1] * stats["entropy"]).sum()
        expected_objective = expected_objective + (weights[1] * expected["entropy"]).sum()
    (grad,) = torch.autograd.grad(objective, model_logits)
    (expected_grad,) = torch.autograd.grad(expected_objective, model_logits)
    torch.testing.assert_close(grad, expected_grad)


def test_bf16_logits_get_bf16_gradients_of_the_float32_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 7, 13, generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, 13, (2, 7), generator=g)
    log_probs = response_stats(logits, labels, temperature=TEMPERATURE, chunk_rows=3)["log_probs"]
    expected = reference(logits, labels)["log_probs"]
    torch.testing.assert_close(log_probs, expected.detach())
    (grad,) = torch.autograd.grad(log_probs.sum(), logits)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad, expected_grad)


def test_without_grad_nothing_requires_grad():
    logits = torch.randn(2, 4, 5, requires_grad=True)
    with torch.no_grad():
        stats = response_stats(logits, torch.zeros(2, 4, dtype=torch.long), temperature=1.0, with_entropy=True)
    assert set(stats) == {"log_probs", "entropy"}
    assert not any(value.requires_grad for value in stats.values())


class FullSizeAllocations(TorchDispatchMode):
    """Counts the tensors of at least ``numel`` elements that ops create."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # Views (slices of the buffer) share storage and allocate nothing.
        if not func.is_view:
            results = out if isinstance(out, (tuple, list)) else (out,)
            self.count += sum(isinstance(r, torch.Tensor) and r.numel() >= self.numel for r in results)
        return out


def full_size_allocations_in_backward(chunks: int) -> int:
    b, t, v = 4, 16, 32
    model_logits = torch.randn(b, t + 1, v, requires_grad=True)
    labels = torch.randint(0, v, (b, t))
    stats = response_stats(
        model_logits[:, :-1],
        labels,
        temperature=1.0,
        with_entropy=True,
        entropy_grad=True,
        chunk_rows=b * t // chunks,
    )
    with FullSizeAllocations(b * t * v) as mode:
        (stats["log_probs"].sum() + stats["entropy"].sum()).backward()
    return mode.count


def test_backward_allocates_no_full_size_gradient_per_chunk():
    few, many = full_size_allocations_in_backward(4), full_size_allocations_in_backward(32)
    # One gradient of the [:, :-1] view, one of the model's logits (the slice's backward).
    assert few == many <= 2, (few, many)
