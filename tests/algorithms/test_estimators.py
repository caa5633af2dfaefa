"""Advantage estimators: hand-computed cases, invariants, edge cases and registry errors."""

import dataclasses
import math

import pytest
import torch

from dsrl.algorithms import (
    EstimatorInputs,
    compute_advantages,
    estimator_names,
    estimator_options,
    masked_whiten,
    reads_policy,
    register_estimator,
)
from dsrl.algorithms import estimators as estimators_module

EPS = 1e-6  # GRPO's std epsilon


def outcome(scores, lengths, width=None):
    """Rewards with each score on the last response token, right-padded masks."""
    scores = torch.as_tensor(scores, dtype=torch.float32)
    lengths = torch.as_tensor(lengths)
    width = width or int(lengths.max())
    mask = (torch.arange(width) < lengths.unsqueeze(-1)).float()
    rewards = torch.zeros(len(scores), width)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    rewards[rows, lengths[rows] - 1] = scores[rows]
    return rewards, mask


def inputs(scores, lengths, group_ids, width=None, **extra):
    rewards, mask = outcome(scores, lengths, width)
    return EstimatorInputs(rewards, mask, torch.as_tensor(group_ids, dtype=torch.int64), **extra)


def per_response(advantages, mask):
    """The scalar an outcome estimator broadcast over each (non-empty) response."""
    return advantages.sum(-1) / mask.sum(-1).clamp(min=1)


def random_batch(seed, batch=24, width=10, group=4):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    scores = torch.randn(batch, generator=gen)
    # arbitrary (huge, negative) int64 ids, members of a group not adjacent
    ids = (torch.arange(batch) // group) * 1_000_000_007 - 5
    ids = ids[torch.randperm(batch, generator=gen)]
    return inputs(scores, lengths, ids, width), scores, ids


# ---------------------------------------------------------------------------------------------
# GRPO / Dr.GRPO


def test_grpo_by_hand_with_a_group_of_one():
    batch = inputs([1.0, 2.0, 3.0, 5.0], [2, 3, 1, 2], [7, 7, 7, 9])
    advantages, returns = compute_advantages("grpo", batch)
    # group 7: mean 2, unbiased std 1; group 9 alone: mean 0, std 1
    expected = torch.tensor([-1.0, 0.0, 1.0, 5.0]) / (1.0 + EPS)
    torch.testing.assert_close(advantages, expected.unsqueeze(-1) * batch.response_mask)
    assert returns is advantages


def test_dr_grpo_by_hand():
    batch = inputs([1.0, 2.0, 3.0, 5.0], [2, 3, 1, 2], [7, 7, 7, 9])
    advantages, _ = compute_advantages("grpo", batch, norm_adv_by_std=False)
    torch.testing.assert_close(advantages, torch.tensor([[-1.0], [0.0], [1.0], [5.0]]) * batch.response_mask)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_invariants(seed):
    batch, scores, ids = random_batch(seed)
    advantages, _ = compute_advantages("grpo", batch)
    dr_advantages, _ = compute_advantages("grpo", batch, norm_adv_by_std=False)
    a, dr = per_response(advantages, batch.response_mask), per_response(dr_advantages, batch.response_mask)
    for gid in ids.unique():
        members = ids == gid
        assert a[members].sum().abs().item() < 1e-5  # zero-sum within a group of size > 1
        torch.testing.assert_close(dr[members], scores[members] - scores[members].mean())
        torch.testing.assert_close(a[members], dr[members] / (scores[members].std() + EPS))


def test_grpo_identical_scores_give_zero_not_nan():
    advantages, _ = compute_advantages("grpo", inputs([1.0, 1.0, 1.0], [1, 2, 3], [0, 0, 0]))
    assert torch.equal(advantages, torch.zeros(3, 3))


def test_grpo_vectorized_is_grpo_and_rloo_vectorized_is_rloo_but_for_groups_of_one():
    batch, _, _ = random_batch(3)
    assert torch.equal(compute_advantages("grpo_vectorized", batch)[0], compute_advantages("grpo", batch)[0])
    assert torch.equal(compute_advantages("rloo_vectorized", batch)[0], compute_advantages("rloo", batch)[0])
    # verl 0.9.1: its loop RLOO gives a group of one its score, its vectorised one 0
    alone = inputs([2.0, 1.0, 3.0], [1, 2, 1], [5, 5, 6], 2)
    for lw in (False, True):
        assert compute_advantages("rloo", alone, length_weighted_baseline=lw)[0][2, 0].item() == 3.0
        vectorized = compute_advantages("rloo_vectorized", alone, length_weighted_baseline=lw)[0]
        assert vectorized[2].tolist() == [0.0, 0.0]
        assert torch.equal(vectorized[:2], compute_advantages("rloo", alone, length_weighted_baseline=lw)[0][:2])


def whitened(per_response, mask):
    """verl's batch whitening of a broadcast per-response value: token-level mean and unbiased std (+ 1e-8)."""
    tokens = torch.as_tensor(per_response, dtype=torch.float32).repeat_interleave(mask.sum(-1).long())
    std = math.sqrt(tokens.var().item() + 1e-8)
    return (torch.as_tensor(per_response).unsqueeze(-1) - tokens.mean()) / std * mask


# ---------------------------------------------------------------------------------------------
# GDPO


def gdpo_batch(**components):
    """Group 7 (rows 0-2), group 9 (rows 3-5, all-equal acc), row 6 alone; lengths 2 1 3 2 2 1 1."""
    components = {k: torch.tensor(v) for k, v in components.items()}
    return inputs([0.0] * 7, [2, 1, 3, 2, 2, 1, 1], [7, 7, 7, 9, 9, 9, 4], reward_components=components)


def test_gdpo_by_hand_normalises_each_component_then_weights_then_whitens():
    batch = gdpo_batch(acc=[0.0, 1.0, 2.0, 5.0, 5.0, 5.0, 3.0], format=[4.0, 2.0, 0.0, 1.0, 2.0, 3.0, -1.0])
    advantages, returns = compute_advantages("gdpo", batch, gdpo_reward_weights=[1.0, 0.5])
    # acc:    group 7 mean 1 std 1 -> -1 0 1; group 9 all equal -> 0 0 0; alone: mean 0 std 1 -> 3
    # format: group 7 mean 2 std 2 -> 1 0 -1; group 9 mean 2 std 1 -> -1 0 1; alone -> -1
    acc = torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0]) / (1 + EPS)
    fmt = torch.tensor([2.0, 0.0, -2.0]) / (2 + EPS)
    fmt = torch.cat([fmt, torch.tensor([-1.0, 0.0, 1.0, -1.0]) / (1 + EPS)])
    summed = acc + 0.5 * fmt  # about -0.5 0 0.5 | -0.5 0 0.5 | 2.5
    torch.testing.assert_close(summed, torch.tensor([-0.5, 0.0, 0.5, -0.5, 0.0, 0.5, 2.5]), atol=1e-5, rtol=0)
    torch.testing.assert_close(advantages, whitened(summed, batch.response_mask))
    assert returns is advantages


def test_gdpo_without_std_and_with_equal_weights():
    batch = gdpo_batch(acc=[0.0, 1.0, 2.0, 5.0, 5.0, 5.0, 3.0], format=[4.0, 2.0, 0.0, 1.0, 2.0, 3.0, -1.0])
    advantages, _ = compute_advantages("gdpo", batch, norm_adv_by_std=False)
    # centred only: acc -1 0 1 | 0 0 0 | 3, format 2 0 -2 | -1 0 1 | -1; weights None = 1, 1
    summed = torch.tensor([1.0, 0.0, -1.0, -1.0, 0.0, 1.0, 2.0])
    torch.testing.assert_close(advantages, whitened(summed, batch.response_mask))


def test_gdpo_of_one_component_is_whitened_grpo():
    batch, scores, _ = random_batch(3)
    gdpo = dataclasses.replace(batch, reward_components={"acc": scores})
    grpo, _ = compute_advantages("grpo", batch)
    expected = masked_whiten(grpo, batch.response_mask) * batch.response_mask
    torch.testing.assert_close(compute_advantages("gdpo", gdpo)[0], expected)


def test_gdpo_all_equal_components_give_zero_not_nan():
    batch = gdpo_batch(acc=[1.0] * 7)
    advantages, _ = compute_advantages("gdpo", dataclasses.replace(batch, group_ids=torch.zeros(7, dtype=torch.long)))
    assert torch.equal(advantages, torch.zeros_like(advantages))


def test_gdpo_weights_must_match_the_components():
    batch = gdpo_batch(acc=[0.0] * 7, format=[1.0] * 7)
    with pytest.raises(ValueError, match="3 weights for 2 reward components"):
        compute_advantages("gdpo", batch, gdpo_reward_weights=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="gdpo.*reward_components"):
        compute_advantages("gdpo", dataclasses.replace(batch, reward_components={}))


# ---------------------------------------------------------------------------------------------
# RLOO, OPO, REINFORCE++-baseline, GPG, pass@k


def test_rloo_by_hand_with_a_group_of_one():
    batch = inputs([1.0, 2.0, 6.0, 4.0], [1, 1, 1, 1], [0, 0, 0, 1])
    advantages, returns = compute_advantages("rloo", batch)
    # 1 - (2+6)/2, 2 - (1+6)/2, 6 - (1+2)/2; alone: own score
    torch.testing.assert_close(advantages, torch.tensor([[-3.0], [-1.5], [4.5], [4.0]]))
    assert returns is advantages


@pytest.mark.parametrize("seed", [0, 1])
def test_rloo_is_score_minus_mean_of_the_others(seed):
    batch, scores, ids = random_batch(seed)
    a = per_response(compute_advantages("rloo", batch)[0], batch.response_mask)
    for i in range(len(scores)):
        others = (ids == ids[i]) & (torch.arange(len(scores)) != i)
        assert a[i].item() == pytest.approx((scores[i] - scores[others].mean()).item(), abs=1e-5)


def test_opo_by_hand():
    batch = inputs([2.0, 0.0, 3.0], [1, 3, 2], [0, 0, 1])
    advantages, returns = compute_advantages("opo", batch)
    # baseline (1·2 + 3·0) / 4 = 0.5; group of one: baseline 0
    torch.testing.assert_close(advantages, torch.tensor([[1.5], [-0.5], [3.0]]) * batch.response_mask)
    assert returns is advantages


def test_opo_with_equal_lengths_is_dr_grpo():
    gen = torch.Generator().manual_seed(5)
    batch = inputs(torch.randn(12, generator=gen), [4] * 12, torch.arange(12) // 3)
    opo, _ = compute_advantages("opo", batch)
    dr_grpo, _ = compute_advantages("grpo", batch, norm_adv_by_std=False)
    torch.testing.assert_close(opo, dr_grpo)


def test_opo_group_of_empty_responses_is_zero_not_nan():
    advantages, _ = compute_advantages("opo", inputs([0.0, 0.0, 1.0], [0, 0, 1], [0, 0, 1]))
    assert torch.equal(advantages, torch.tensor([[0.0], [0.0], [1.0]]))


def test_reinforce_plus_plus_baseline_by_hand():
    batch = inputs([1.0, 3.0, 2.0], [1, 2, 1], [0, 0, 5])
    advantages, returns = compute_advantages("reinforce_plus_plus_baseline", batch)
    # centred scores -1, 1 (group of two), 2 (alone); token values -1 | 1, 1 | 2
    tokens = torch.tensor([-1.0, 1.0, 1.0, 2.0])
    mean = tokens.mean()
    std = math.sqrt(((tokens - mean) ** 2).sum().item() / 3 + 1e-8)
    expected = torch.tensor([[-1.0, 0.0], [1.0, 1.0], [2.0, 0.0]])
    expected = (expected - mean) / std * batch.response_mask
    torch.testing.assert_close(advantages, expected)
    assert returns is advantages


def test_length_weighted_rloo_by_hand():
    batch = inputs([1.0, 0.0, 2.0, 4.0], [1, 2, 3, 2], [0, 0, 0, 1])
    advantages, _ = compute_advantages("rloo", batch, length_weighted_baseline=True)
    # row 0: others (2·0 + 3·2) / 5 = 1.2; row 1: (1·1 + 3·2) / 4 = 1.75; row 2: (1·1 + 2·0) / 3; alone: 0
    expected = torch.tensor([[1.0 - 1.2], [0.0 - 1.75], [2.0 - 1.0 / 3.0], [4.0]]) * batch.response_mask
    torch.testing.assert_close(advantages, expected)


def test_length_weighted_rloo_baseline_is_zero_when_the_others_are_empty():
    batch = inputs([1.0, 3.0, 5.0], [2, 0, 1], [0, 0, 1])
    advantages, _ = compute_advantages("rloo", batch, length_weighted_baseline=True)
    # row 0: the only other response is empty -> baseline 0; row 1 has no token; row 2 alone
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 1.0], [0.0, 0.0], [5.0, 0.0]]))


def test_length_weighted_reinforce_plus_plus_baseline_by_hand():
    batch = inputs([1.0, 0.0, 2.0, 4.0], [1, 2, 3, 2], [0, 0, 0, 1])
    advantages, _ = compute_advantages("reinforce_plus_plus_baseline", batch, length_weighted_baseline=True)
    # group baseline (1·1 + 2·0 + 3·2) / 6 = 7/6; alone: baseline 0; then token-level whitening
    centred = [1.0 - 7 / 6, 0.0 - 7 / 6, 2.0 - 7 / 6, 4.0]
    torch.testing.assert_close(advantages, whitened(centred, batch.response_mask))


@pytest.mark.parametrize("name", ["rloo", "rloo_vectorized", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("seed", [0, 1])
def test_length_weighted_baseline_with_equal_lengths_is_the_unweighted_one(name, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])  # row 5 alone
    batch = inputs(torch.randn(10, generator=gen), [4] * 10, ids)
    weighted, _ = compute_advantages(name, batch, length_weighted_baseline=True)
    torch.testing.assert_close(weighted, compute_advantages(name, batch)[0])


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus_baseline"])
def test_length_weighted_baseline_changes_the_result_with_unequal_lengths(name):
    # two groups: the batch whitening would remove the shift of a single group's baseline
    batch = inputs([1.0, 0.0, 2.0, 1.0, 3.0], [1, 2, 3, 1, 1], [0, 0, 0, 1, 1])
    weighted, _ = compute_advantages(name, batch, length_weighted_baseline=True)
    assert not torch.allclose(weighted, compute_advantages(name, batch)[0])


def test_gpg_by_hand():
    batch = inputs([1.0, 0.0, 0.0, 3.0], [1, 1, 1, 1], [0, 0, 1, 1])
    advantages, _ = compute_advantages("gpg", batch)
    # α = B / #nonzero = 4 / 2; group means 0.5 and 1.5
    torch.testing.assert_close(advantages, torch.tensor([[1.0], [-1.0], [-3.0], [3.0]]))


def test_grpo_passk_by_hand():
    batch = inputs([1.0, 3.0, 2.0, 2.0, 2.0], [1, 1, 1, 1, 1], [4, 4, 4, 8, 8])
    norm, _ = compute_advantages("grpo_passk", batch)
    plain, _ = compute_advantages("grpo_passk", batch, norm_adv_by_std=False)
    # only the best of each group learns: 3 - 2 (std of [1, 3, 2] is 1); a tie gives 0
    torch.testing.assert_close(plain, torch.tensor([[0.0], [1.0], [0.0], [0.0], [0.0]]))
    torch.testing.assert_close(norm, plain / (1.0 + EPS))


def test_grpo_passk_rejects_a_group_of_one():
    with pytest.raises(RuntimeError, match="at least two responses"):
        compute_advantages("grpo_passk", inputs([1.0, 2.0, 3.0], [1, 1, 1], [0, 0, 1]))


# ---------------------------------------------------------------------------------------------
# token-level estimators


def test_reinforce_plus_plus_returns_by_hand_with_an_observation_hole():
    rewards = torch.tensor([[1.0, 9.0, 2.0, 4.0], [1.0, 2.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    batch = EstimatorInputs(rewards, mask, torch.tensor([0, 1]))
    advantages, returns = compute_advantages("reinforce_plus_plus", batch, gamma=0.5)
    # row 0: 4; 2 + 0.5·4 = 4; hole: 0 and G carried; 1 + 0.5·4 = 3.  row 1: 4; 2 + 2; 1 + 2
    torch.testing.assert_close(returns, torch.tensor([[3.0, 0.0, 4.0, 4.0], [3.0, 4.0, 4.0, 0.0]]))
    torch.testing.assert_close(advantages, masked_whiten(returns, mask) * mask)


def test_gae_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 2.0]])
    values = torch.tensor([[1.0, 2.0, 3.0]])
    batch = EstimatorInputs(rewards, torch.ones(1, 3), torch.tensor([0]), values=values)
    advantages, returns = compute_advantages("gae", batch, gamma=0.5, lam=0.5)
    # δ = [1 + 0.5·2 - 1, 0 + 0.5·3 - 2, 2 - 3] = [1, -0.5, -1];  Â = δ_t + 0.25 Â_{t+1}
    raw = torch.tensor([[0.8125, -0.75, -1.0]])
    torch.testing.assert_close(returns, raw + values)
    torch.testing.assert_close(advantages, masked_whiten(raw, torch.ones(1, 3)))


def test_gae_skips_observation_holes_and_padding():
    rewards = torch.tensor([[1.0, 5.0, 0.0, 2.0, 0.0], [1.0, 0.0, 2.0, 0.0, 0.0]])
    values = torch.tensor([[1.0, 7.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    batch = EstimatorInputs(rewards, mask, torch.tensor([0, 1]), values=values)
    advantages, returns = compute_advantages("gae", batch, gamma=0.5, lam=0.5)
    # row 0 without its hole is row 1; the hole carries Â of the next valid token; padding holds 0
    raw = torch.tensor([[0.8125, -0.75, -0.75, -1.0, 0.0], [0.8125, -0.75, -1.0, 0.0, 0.0]])
    torch.testing.assert_close(returns, raw + values)
    torch.testing.assert_close(advantages, masked_whiten(raw, mask))
    on_mask = advantages[mask.bool()]
    assert on_mask.mean().abs().item() < 1e-6
    assert on_mask.var().item() == pytest.approx(1.0, abs=1e-5)


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    gen = torch.Generator().manual_seed(6)
    rewards, mask = outcome(torch.randn(5, generator=gen), [3, 6, 1, 6, 4])
    rewards = rewards + 0.1 * torch.randn(5, 6, generator=gen) * mask
    values = torch.randn(5, 6, generator=gen)
    batch = EstimatorInputs(rewards, mask, torch.arange(5), values=values)
    _, returns = compute_advantages("gae", batch, gamma=1.0, lam=1.0)
    reward_to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(returns * mask, reward_to_go * mask)


def test_remax_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    batch = EstimatorInputs(rewards, mask, torch.tensor([0, 1]), reward_baselines=torch.tensor([0.4, 3.0]))
    advantages, returns = compute_advantages("remax", batch)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.6, 0.6, 0.6], [-1.0, -1.0, 0.0]]))


# ---------------------------------------------------------------------------------------------
# optimal token baseline


def otb_inputs(rewards, mask, group_ids, pi=0.5, sum_pi_sq=0.5, rollout_is_weights=None):
    """w_t = 1 - 2π + Σπ² = 0.5 everywhere by default."""
    return EstimatorInputs(
        rewards,
        mask,
        torch.as_tensor(group_ids),
        old_log_probs=torch.full_like(rewards, math.log(pi)),
        sum_pi_squared=torch.full_like(rewards, sum_pi_sq),
        rollout_is_weights=rollout_is_weights,
    )


def test_otb_by_hand():
    rewards, mask = outcome([1.0, 0.0, 2.0], [2, 2, 2])
    advantages, returns = compute_advantages("optimal_token_baseline", otb_inputs(rewards, mask, [0, 0, 1]))
    # equal W: B_t = mean of G_t over the group = 0.5; the group of one keeps its return
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5], [-0.5, -0.5], [2.0, 2.0]]))


def test_otb_weights_returns_by_path_variance_and_is_weights():
    rewards, mask = outcome([1.0, 0.0], [1, 1])
    weights = torch.tensor([[1.0], [2.0]])  # ρ² scales W: 1 and 4
    advantages, _ = compute_advantages(
        "optimal_token_baseline", otb_inputs(rewards, mask, [0, 0], rollout_is_weights=weights)
    )
    baseline = (1.0 * 0.5) / (0.5 + 4 * 0.5 + 1e-8)
    torch.testing.assert_close(advantages, torch.tensor([[1.0 - baseline], [-baseline]]))


def test_otb_zero_tail_of_the_unique_longest_response():
    rewards, mask = outcome([1.0, 3.0], [1, 3])
    batch = otb_inputs(rewards, mask, [0, 0])
    with_tail, _ = compute_advantages("optimal_token_baseline", batch)
    without_tail, _ = compute_advantages("optimal_token_baseline", batch, handle_zero_tail=False)
    # t = 0: B = (1·0.5 + 3·0.5) / (0.5 + 0.5) = 2; t ≥ 1 only the long response is left
    torch.testing.assert_close(with_tail, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 3.0, 3.0]]))
    assert without_tail[1, 1:].abs().max().item() < 1e-6  # without: its own return is the baseline there
    torch.testing.assert_close(without_tail[:, 0], with_tail[:, 0])


def test_otb_no_zero_tail_when_the_longest_length_is_shared():
    rewards, mask = outcome([1.0, 3.0, 2.0], [3, 3, 1])
    batch = otb_inputs(rewards, mask, [0, 0, 0])
    with_tail, _ = compute_advantages("optimal_token_baseline", batch)
    without_tail, _ = compute_advantages("optimal_token_baseline", batch, handle_zero_tail=False)
    torch.testing.assert_close(with_tail, without_tail)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_otb_with_equal_path_weights_is_the_per_position_group_mean_of_returns(name):
    gen = torch.Generator().manual_seed(7)
    rewards = torch.randn(12, 5, generator=gen)
    mask = torch.ones(12, 5)
    ids = torch.arange(12) // 4
    advantages, returns = compute_advantages(name, otb_inputs(rewards, mask, ids))
    group_mean = returns.view(3, 4, 5).mean(dim=1, keepdim=True).expand(3, 4, 5).reshape(12, 5)
    torch.testing.assert_close(advantages, returns - group_mean, atol=1e-5, rtol=1e-5)


def test_tir_otb_pairs_tokens_by_compacted_position():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])  # row 0 has an observation token at t = 1
    batch = otb_inputs(rewards, mask, [0, 0])
    tir, returns = compute_advantages("tir_optimal_token_baseline", batch)
    # compacted: row 0 = tokens (t0, t2), row 1 = (t0, t1); G = [1, 1] and [0, 0]; B = 0.5 at both
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(tir, torch.tensor([[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]]))
    # the position-aligned OTB pairs row 1's t1 with row 0's hole instead
    otb, _ = compute_advantages("optimal_token_baseline", batch, handle_zero_tail=False)
    torch.testing.assert_close(otb, torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]]), atol=1e-6, rtol=0)


def test_tir_otb_empty_responses_do_not_count_towards_the_group():
    rewards, mask = outcome([0.0, 2.0], [0, 2])
    batch = otb_inputs(rewards, mask, [3, 3])
    for tail in (True, False):
        advantages, returns = compute_advantages("tir_optimal_token_baseline", batch, handle_zero_tail=tail)
        torch.testing.assert_close(advantages, returns)  # a group of one: baseline 0


# ---------------------------------------------------------------------------------------------
# shared behaviour


ALL = [n for n in estimator_names() if n not in ("grpo_vectorized", "rloo_vectorized")]


def full_inputs(mask_dtype=torch.float32, seed=8):
    gen = torch.Generator().manual_seed(seed)
    rewards, mask = outcome(torch.randn(12, generator=gen), torch.randint(1, 7, (12,), generator=gen), 6)
    mask[0, 1] = 0.0  # an observation hole
    return EstimatorInputs(
        rewards,
        mask.to(mask_dtype),
        torch.arange(12) // 3,
        values=torch.randn(12, 6, generator=gen),
        old_log_probs=-torch.rand(12, 6, generator=gen),
        sum_pi_squared=torch.rand(12, 6, generator=gen) * 0.5,
        rollout_is_weights=torch.rand(12, 6, generator=gen) + 0.5,
        reward_baselines=torch.randn(12, generator=gen),
        reward_components={"acc": torch.randn(12, generator=gen), "format": torch.randn(12, generator=gen)},
    )


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("mask_dtype", [torch.long, torch.bool])
def test_integer_and_bool_masks_give_the_float_result(name, mask_dtype):
    expected = compute_advantages(name, full_inputs(), gamma=0.9, lam=0.8)
    got = compute_advantages(name, full_inputs(mask_dtype), gamma=0.9, lam=0.8)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ALL)
def test_shapes_and_no_gradient(name):
    batch = full_inputs()
    rewards = batch.token_level_rewards.clone().requires_grad_()
    batch = EstimatorInputs(**{**batch.__dict__, "token_level_rewards": rewards})
    advantages, returns = compute_advantages(name, batch)
    assert advantages.shape == returns.shape == rewards.shape
    assert not advantages.requires_grad and not returns.requires_grad
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("gae", "values"),
        ("remax", "reward_baselines"),
        ("gdpo", "reward_components"),
        ("optimal_token_baseline", "old_log_probs"),
        ("tir_optimal_token_baseline", "sum_pi_squared"),
    ],
)
def test_missing_required_input_is_named(name, field):
    batch = EstimatorInputs(**{**full_inputs().__dict__, field: None})
    with pytest.raises(ValueError, match=f"{name}.*EstimatorInputs.{field}"):
        compute_advantages(name, batch)


def test_inputs_with_mismatched_shapes_are_rejected():
    rewards, mask = outcome([1.0, 2.0], [2, 2])
    with pytest.raises(ValueError, match="response_mask"):
        EstimatorInputs(rewards, mask[:, :1], torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="group_ids"):
        EstimatorInputs(rewards, mask, torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        EstimatorInputs(rewards[0], mask[0], torch.tensor([0]))
    with pytest.raises(ValueError, match=r"reward_components\['acc'\] must be \[B\]"):
        EstimatorInputs(rewards, mask, torch.tensor([0, 0]), reward_components={"acc": torch.zeros(3)})


def test_registry_lists_the_verl_names():
    expected = {
        "gae",
        "grpo",
        "grpo_vectorized",
        "rloo",
        "rloo_vectorized",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
        "optimal_token_baseline",
        "tir_optimal_token_baseline",
        "gpg",
        "grpo_passk",
        "gdpo",
    }
    assert set(estimator_names()) == expected
    assert estimator_names() == sorted(estimator_names())


def test_unknown_estimator_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown advantage estimator 'grpoo'") as error:
        compute_advantages("grpoo", full_inputs())
    assert ", ".join(estimator_names()) in str(error.value)


def test_duplicate_registration_is_rejected():
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_estimator("grpo")(lambda inputs, **_: (inputs.token_level_rewards,) * 2)


def test_a_registered_estimator_is_called_with_the_shared_signature():
    seen = {}

    def constant(inputs, *, gamma, lam, norm_adv_by_std, handle_zero_tail):
        seen.update(gamma=gamma, lam=lam, norm=norm_adv_by_std, tail=handle_zero_tail)
        return inputs.response_mask * 2.0, inputs.response_mask

    register_estimator("test_constant")(constant)
    try:
        batch = full_inputs()
        advantages, _ = compute_advantages("test_constant", batch, gamma=0.3, lam=0.4, norm_adv_by_std=False)
        assert torch.equal(advantages, batch.response_mask * 2.0)
        assert seen == {"gamma": 0.3, "lam": 0.4, "norm": False, "tail": True}
        assert "test_constant" in estimator_names()
    finally:
        estimators_module._ESTIMATORS.pop("test_constant")
        estimators_module._OPTIONS.pop("test_constant")


def test_estimators_declare_their_options():
    assert estimator_options("gdpo") == {"gdpo_reward_weights": None}
    for name in ("rloo", "rloo_vectorized", "reinforce_plus_plus_baseline"):
        assert estimator_options(name) == {"length_weighted_baseline": False}
    assert estimator_options("grpo") == {}
    with pytest.raises(ValueError, match="unknown advantage estimator 'grpoo'"):
        estimator_options("grpoo")


def test_an_unknown_option_lists_the_valid_ones():
    with pytest.raises(
        ValueError, match="'rloo' has no option gdpo_reward_weights; its options: length_weighted_baseline"
    ):
        compute_advantages("rloo", full_inputs(), gdpo_reward_weights=[1.0])
    with pytest.raises(ValueError, match="'grpo' has no option length_weighted_baseline; its options: none"):
        compute_advantages("grpo", full_inputs(), length_weighted_baseline=True)


def test_a_user_estimator_gets_its_declared_options_with_defaults():
    seen = []

    def scaled(inputs, *, scale, **_):
        seen.append(scale)
        return (inputs.response_mask * scale,) * 2

    register_estimator("test_scaled", options={"scale": 2.0})(scaled)
    try:
        compute_advantages("test_scaled", full_inputs())
        compute_advantages("test_scaled", full_inputs(), scale=3.0)
        assert seen == [2.0, 3.0]
    finally:
        estimators_module._ESTIMATORS.pop("test_scaled")
        estimators_module._OPTIONS.pop("test_scaled")


@pytest.mark.parametrize("name", estimator_names())
def test_an_estimator_declared_policy_free_computes_without_the_policy(name):
    """``reads_policy`` lets the trainer skip the old-log-prob pass; an estimator that says it does not
    read the policy must give the same result with ``old_log_probs`` and ``sum_pi_squared`` absent."""
    if reads_policy(name):
        assert name in ("optimal_token_baseline", "tir_optimal_token_baseline")
        return
    inputs = full_inputs()
    without = dataclasses.replace(inputs, old_log_probs=None, sum_pi_squared=None)
    for expected, got in zip(compute_advantages(name, inputs), compute_advantages(name, without), strict=True):
        torch.testing.assert_close(got, expected)


def test_a_user_estimator_is_assumed_to_read_the_policy_unless_it_says_not():
    register_estimator("test_reads")(lambda inputs, **_: (inputs.response_mask,) * 2)
    register_estimator("test_free", reads_policy=False)(lambda inputs, **_: (inputs.response_mask,) * 2)
    try:
        assert reads_policy("test_reads") and not reads_policy("test_free")
    finally:
        for name in ("test_reads", "test_free"):
            estimators_module._ESTIMATORS.pop(name)
            estimators_module._OPTIONS.pop(name)
        estimators_module._POLICY_FREE.discard("test_free")
