"""dsrl.engines.grad_variance's formula on constructed micro-batch gradients: the weighted variance of the
per-micro-batch estimates h_k = g_k / w_k around G = sum_k g_k, from the sums the update loop keeps."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsrl.engines.grad_variance import grad_variance, micro_batch_share


def from_sums(g: np.ndarray, shares: np.ndarray) -> tuple[float, float]:
    """What run_ppo_updates gives for micro-batch gradients ``g`` [K, D] with shares ``shares`` [K]."""
    G = g.sum(0)
    return grad_variance(float(((g**2).sum(1) / shares).sum()), float((shares**2).sum()), float(np.linalg.norm(G)))


def test_equal_shares_give_the_unbiased_variance_of_the_micro_batch_estimates():
    rng = np.random.default_rng(0)
    g = rng.normal(size=(4, 6))
    shares = np.full(4, 0.25)
    variance, relative = from_sums(g, shares)
    h = g / shares[:, None]  # each micro-batch's own estimate of G
    expected = h.var(axis=0, ddof=1).sum()  # the trace of their covariance
    assert variance == pytest.approx(expected, rel=1e-12)
    assert relative == pytest.approx(expected / (g.sum(0) ** 2).sum(), rel=1e-12)


def test_unequal_shares_weigh_each_estimate_by_its_share():
    rng = np.random.default_rng(1)
    g = rng.normal(size=(3, 5))
    shares = np.array([0.5, 0.3, 0.2])
    h, G = g / shares[:, None], g.sum(0)
    expected = (shares * ((h - G) ** 2).sum(1)).sum() / (1 - (shares**2).sum())
    assert from_sums(g, shares)[0] == pytest.approx(expected, rel=1e-12)


def test_identical_estimates_have_no_variance_and_one_micro_batch_has_none_defined():
    g = np.tile(np.array([[1.0, -2.0, 0.5]]), (2, 1)) / 2  # h_1 = h_2 = G
    assert from_sums(g, np.array([0.5, 0.5]))[0] == pytest.approx(0.0, abs=1e-12)
    assert all(math.isnan(v) for v in from_sums(g[:1] * 2, np.array([1.0])))


def test_shares_count_tokens_for_token_modes_and_answered_sequences_for_sequence_modes():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert micro_batch_share(mask, loss_agg_mode="token-mean", num_tokens=8.0, num_seqs=5.0) == 0.5
    assert micro_batch_share(mask, loss_agg_mode="seq-mean-token-mean", num_tokens=8.0, num_seqs=5.0) == 0.4
