"""Masked reductions and logit-derived quantities: hand-computed cases and invariants."""

import math

import pytest
import torch

from dsrl.algorithms import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_whiten,
    sum_pi_squared_from_logits,
)
from dsrl.algorithms.tensor_ops import masked_whiten_

NAN = float("nan")


def test_masked_sum_and_mean_by_hand_ignore_masked_nan():
    values = torch.tensor([[1.0, 2.0, NAN], [4.0, math.inf, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_sum(values, mask).item() == 13.0
    assert masked_mean(values, mask).item() == pytest.approx(13 / 4)
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 5.0]))
    torch.testing.assert_close(masked_sum(values, mask.bool(), dim=0), torch.tensor([5.0, 2.0, 6.0]))


def test_masked_mean_of_empty_mask_is_zero():
    assert masked_mean(torch.tensor([3.0, NAN]), torch.tensor([0, 0])).item() == 0.0


def test_masked_whiten_by_hand():
    values = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # mean 2, unbiased variance ((-1)² + 0 + 1²) / 2 = 1
    expected = (values - 2.0) / math.sqrt(1.0 + 1e-8)
    torch.testing.assert_close(masked_whiten(values, mask), expected)


def test_masked_whiten_gives_mean_zero_unit_variance_on_mask():
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(16, 9, generator=gen) * 5 + 3
    mask = (torch.rand(16, 9, generator=gen) > 0.4).float()
    out = masked_whiten(values, mask)
    picked = out[mask.bool()]
    assert picked.mean().abs().item() < 1e-5
    assert picked.var(unbiased=True).item() == pytest.approx(1.0, abs=1e-4)


def test_masked_whiten_statistics_ignore_masked_nan_and_inf():
    values = torch.tensor([1.0, 2.0, 3.0, NAN, math.inf])
    mask = torch.tensor([1, 1, 1, 0, 0])
    out = masked_whiten(values, mask)
    torch.testing.assert_close(out[:3], torch.tensor([-1.0, 0.0, 1.0]))
    assert math.isnan(out[3].item()) and math.isinf(out[4].item())  # shifted and scaled, not hidden


def test_masked_whiten_needs_two_masked_elements():
    with pytest.raises(RuntimeError, match="at least two"):
        masked_whiten(torch.tensor([1.0, 2.0]), torch.tensor([1, 0]))


def test_masked_whiten_in_place_matches_and_accepts_count_weights():
    gen = torch.Generator().manual_seed(1)
    per_row = torch.randn(6, generator=gen)
    lengths = torch.tensor([3.0, 1.0, 0.0, 4.0, 2.0, 2.0])
    mask = (torch.arange(4) < lengths.unsqueeze(-1)).float()
    token_level = masked_whiten(per_row.unsqueeze(-1) * mask, mask) * mask
    row_level = per_row.clone()
    assert masked_whiten_(row_level, lengths) is row_level
    torch.testing.assert_close(row_level.unsqueeze(-1) * mask, token_level)


def test_logprobs_from_logits_by_hand_and_against_log_softmax():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert logprobs_from_logits(logits, torch.tensor([1])).item() == pytest.approx(math.log(0.75))
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=gen, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    out = logprobs_from_logits(logits, labels)
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_bf16_logits_are_computed_in_float32():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen).bfloat16()
    labels = torch.tensor([1, 2, 3])
    out = logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, logprobs_from_logits(logits.float(), labels))
    assert entropy_from_logits(logits).dtype == torch.float32
    assert sum_pi_squared_from_logits(logits).dtype == torch.float32


def test_entropy_from_logits_by_hand():
    probs = torch.tensor([0.25, 0.75])
    expected = -(probs * probs.log()).sum()
    assert entropy_from_logits(probs.log()).item() == pytest.approx(expected.item())
    assert entropy_from_logits(torch.zeros(7)).item() == pytest.approx(math.log(7))
    assert entropy_from_logits(torch.tensor([100.0, 0.0, 0.0])).item() == pytest.approx(0.0, abs=1e-6)


def test_sum_pi_squared_by_hand_and_stable_for_large_logits():
    assert sum_pi_squared_from_logits(torch.tensor([0.0, math.log(3.0)])).item() == pytest.approx(10 / 16)
    assert sum_pi_squared_from_logits(torch.zeros(8)).item() == pytest.approx(1 / 8)
    big = torch.tensor([1000.0, 1000.0, -1000.0])
    assert sum_pi_squared_from_logits(big).item() == pytest.approx(0.5, rel=1e-3)  # float32 at |z| = 2000
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 6, 30, generator=gen)
    torch.testing.assert_close(sum_pi_squared_from_logits(logits), torch.softmax(logits, -1).square().sum(-1))
