"""Rollout correction: truncated importance weights and rejection between rollout and trainer."""

import math

import pytest
import torch

from dsrl.algorithms import RolloutCorrection, policy_loss, rollout_correction

# Two responses of lengths 3 and 2 (T = 4); padding holds garbage that must never matter.
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
LOG_RATIO = torch.tensor([[0.5, -0.2, 1.5, 0.0], [-0.1, -2.0, 0.0, 0.0]])  # old - rollout on valid tokens


def inputs():
    rollout = torch.tensor([[-1.0, -2.0, -0.5, float("nan")], [-3.0, -0.1, 7.0, float("-inf")]])
    old = rollout + LOG_RATIO
    old[0, 3], old[1, 3] = float("inf"), 123.0
    return old, rollout


def test_token_level_truncation_caps_each_token_ratio():
    old, rollout = inputs()
    out = rollout_correction(old, rollout, MASK, rollout_is="token", rollout_is_threshold=2.0)
    expected_ratio = LOG_RATIO.exp() * MASK
    torch.testing.assert_close(out.ratio, expected_ratio)
    torch.testing.assert_close(out.weights, expected_ratio.clamp(max=2.0))
    assert out.weights[0, 2] == 2.0 and out.weights[0, 0] == pytest.approx(math.exp(0.5))
    assert torch.equal(out.keep_mask, MASK.float())
    assert out.weights.dtype == torch.float32 and torch.isfinite(out.weights).all()


def test_sequence_level_weight_is_the_product_of_token_ratios_on_every_token():
    old, rollout = inputs()
    out = rollout_correction(old, rollout, MASK, rollout_is="sequence", rollout_is_threshold=5.0)
    seq = torch.tensor([math.exp(0.5 - 0.2 + 1.5), math.exp(-0.1 - 2.0)])
    torch.testing.assert_close(out.ratio, seq[:, None] * MASK)
    torch.testing.assert_close(out.weights, seq.clamp(max=5.0)[:, None] * MASK)
    assert out.weights[0, 0] == 5.0  # exp(1.8) = 6.05 truncated


def test_token_rejection_masks_tokens_outside_the_interval():
    old, rollout = inputs()
    # upper 2 -> lower 1/2: keeps ratios in [0.5, 2]: exp(0.5)=1.65 yes, exp(-0.2) yes, exp(1.5)=4.5 no,
    # exp(-0.1) yes, exp(-2)=0.135 no.
    out = rollout_correction(old, rollout, MASK, rollout_rs="token", rollout_is_threshold=2.0)
    keep = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]).float()
    assert torch.equal(out.keep_mask, keep)
    assert torch.equal(out.weights, keep)  # no IS: the weight is the mask itself
    explicit = rollout_correction(
        old, rollout, MASK, rollout_rs="token", rollout_rs_threshold=5.0, rollout_rs_threshold_lower=0.1
    )
    assert torch.equal(explicit.keep_mask, MASK.float())


def test_sequence_rejection_drops_whole_responses_and_combines_with_truncation():
    old, rollout = inputs()
    out = rollout_correction(
        old, rollout, MASK, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="sequence", rollout_rs_threshold=10.0
    )
    # sequence ratios exp(1.8)=6.05 (kept, <= 10) and exp(-2.1)=0.12 (< 1/10? no: 0.12 >= 0.1, kept)
    assert torch.equal(out.keep_mask, MASK.float())
    tight = rollout_correction(
        old, rollout, MASK, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="sequence", rollout_rs_threshold=5.0
    )
    # upper 5, lower 0.2: both sequences fall outside.
    assert torch.equal(tight.keep_mask, torch.zeros(2, 4))
    assert torch.equal(tight.weights, torch.zeros(2, 4))
    one = rollout_correction(
        old, rollout, MASK, rollout_is="token", rollout_rs="sequence", rollout_rs_threshold=7.0, rollout_rs_threshold_lower=0.01
    )
    assert torch.equal(one.keep_mask, MASK.float())
    torch.testing.assert_close(one.weights, (LOG_RATIO.exp() * MASK).clamp(max=2.0))


def test_on_policy_rollouts_get_weight_one():
    lp = torch.randn(3, 5)
    mask = torch.ones(3, 5)
    for level in ("token", "sequence"):
        out = rollout_correction(lp, lp.clone(), mask, rollout_is=level, rollout_rs=level)
        assert torch.equal(out.weights, mask) and torch.equal(out.ratio, mask)


def test_huge_mismatch_stays_finite():
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[-100.0, -100.0, -100.0]])
    out = rollout_correction(old, rollout, torch.ones(1, 3), rollout_is="sequence", rollout_is_threshold=3.0)
    assert torch.isfinite(out.ratio).all() and out.ratio[0, 0] == pytest.approx(math.exp(20.0), rel=1e-5)
    assert torch.equal(out.weights, torch.full((1, 3), 3.0))


def test_weights_scale_the_policy_loss_per_token():
    old, rollout = inputs()
    out = rollout_correction(old, rollout, MASK, rollout_is="token")
    log_probs = torch.where(MASK.bool(), old, 0.0).requires_grad_()
    adv = torch.ones(2, 4)
    kwargs = {"old_log_probs": log_probs.detach(), "log_probs": log_probs, "advantages": adv, "response_mask": MASK.float()}
    weighted, _ = policy_loss("vanilla", rollout_is_weights=out.weights, **kwargs)
    # On-policy ratio 1: vanilla loss per token is -A = -1, so the weighted token-mean is -mean(w).
    assert weighted.item() == pytest.approx(-(out.weights.sum() / MASK.sum()).item())


def test_result_is_detached_and_bad_levels_are_refused():
    old, rollout = inputs()
    out = rollout_correction(old.requires_grad_(), rollout, MASK, rollout_is="token")
    assert isinstance(out, RolloutCorrection) and not out.weights.requires_grad
    with pytest.raises(ValueError, match="rollout_is='geometric'"):
        rollout_correction(old, rollout, MASK, rollout_is="geometric")
    with pytest.raises(ValueError, match="rollout_rs='seq'"):
        rollout_correction(old, rollout, MASK, rollout_rs="seq")
    with pytest.raises(ValueError, match="rollout_is_threshold=0"):
        rollout_correction(old, rollout, MASK, rollout_is="token", rollout_is_threshold=0)
