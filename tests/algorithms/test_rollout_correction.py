"""Rollout correction: truncated importance weights and rejection between rollout and trainer."""

import math

import pytest
import torch

from dsrl.algorithms import RolloutCorrection, correct_rollout, policy_loss, policy_loss_params, rollout_correction
from dsrl.algorithms.rollout_correction import parse_is_threshold, parse_rs

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


def test_token_k1_rejection_keeps_ratios_between_the_bounds():
    old, rollout = inputs()
    # "0.5_2.0" (and "2.0", lower = 1/2) keeps ratios in [0.5, 2]: exp(0.5)=1.65 yes, exp(-0.2) yes, exp(1.5)=4.5 no,
    # exp(-0.1) yes, exp(-2)=0.135 no.
    keep = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]]).float()
    for threshold in ("0.5_2.0", 2.0):
        out = rollout_correction(old, rollout, MASK, rollout_rs="token_k1", rollout_rs_threshold=threshold)
        assert torch.equal(out.keep_mask, keep)
        assert torch.equal(out.weights, keep)  # no IS: the weight is the mask itself
    wide = rollout_correction(old, rollout, MASK, rollout_rs="token_k1", rollout_rs_threshold="0.1_10.0")
    assert torch.equal(wide.keep_mask, MASK.float())


def test_sequence_rejection_drops_whole_responses_and_combines_with_truncation():
    old, rollout = inputs()
    # seq_sum_k1 = -(sum of log ratios) = -1.8 and 2.1; "10.0" keeps [-log 10, log 10] = [-2.30, 2.30]: both.
    out = rollout_correction(
        old,
        rollout,
        MASK,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="seq_sum_k1",
        rollout_rs_threshold=10.0,
    )
    assert torch.equal(out.keep_mask, MASK.float())
    torch.testing.assert_close(out.weights, (LOG_RATIO.exp() * MASK).clamp(max=2.0))
    # "5.0": [-1.61, 1.61], both outside.
    tight = rollout_correction(
        old,
        rollout,
        MASK,
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="seq_sum_k1",
        rollout_rs_threshold=5.0,
    )
    assert torch.equal(tight.keep_mask, torch.zeros(2, 4))
    assert torch.equal(tight.weights, torch.zeros(2, 4))


def test_on_policy_rollouts_get_weight_one():
    lp = torch.randn(3, 5)
    mask = torch.ones(3, 5)
    for level, rs in (("token", "token_k1,token_k2,token_k3"), ("sequence", "seq_sum_k1,seq_mean_k3,seq_max_k2")):
        out = rollout_correction(lp, lp.clone(), mask, rollout_is=level, rollout_rs=rs, rollout_rs_threshold=1.0)
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
    kwargs = {
        "old_log_probs": log_probs.detach(),
        "log_probs": log_probs,
        "advantages": adv,
        "response_mask": MASK.float(),
    }
    weighted, _ = policy_loss("vanilla", rollout_is_weights=out.weights, **kwargs)
    # On-policy ratio 1: vanilla loss per token is -A = -1, so the weighted token-mean is -mean(w).
    assert weighted.item() == pytest.approx(-(out.weights.sum() / MASK.sum()).item())


def test_result_is_detached_and_bad_levels_are_refused():
    old, rollout = inputs()
    out = rollout_correction(old.requires_grad_(), rollout, MASK, rollout_is="token")
    assert isinstance(out, RolloutCorrection) and not out.weights.requires_grad
    with pytest.raises(ValueError, match="rollout_is: 'geometric'"):
        rollout_correction(old, rollout, MASK, rollout_is="geometric")
    with pytest.raises(ValueError, match="rollout_rs: 'token'.*token_k1"):  # dsrl's older level names
        rollout_correction(old, rollout, MASK, rollout_rs="token", rollout_rs_threshold=2.0)
    with pytest.raises(ValueError, match="rollout_is_threshold: '0' must be a positive"):
        rollout_correction(old, rollout, MASK, rollout_is="token", rollout_is_threshold=0)


# ---------------------------------------------------------------------------------------------
# verl 0.9.1's rejection options, IS thresholds and batch normalisation (correct_rollout)

# Per valid token: k1 = -log r: [-0.5, 0.2, -1.5], [0.1, 2.0]; k2 = (log r)^2 / 2: [0.125, 0.02, 1.125],
# [0.005, 2.0]; k3 = r - 1 - log r: [0.1487, 0.0187, 1.9817], [0.0048, 1.1353].
REJECTION_CASES = [
    ("token_k1", "0.1_1.2", [[1, 0, 1], [1, 0]]),  # verl bounds -log r: ratios in [1/1.2, 1/0.1]
    ("token_k2", 0.1, [[0, 1, 0], [1, 0]]),
    ("token_k3", 0.2, [[1, 1, 0], [1, 0]]),
    ("seq_sum_k1", "0.1_10.0", [[1, 1, 1], [1, 1]]),  # sums -1.8, 2.1
    ("seq_sum_k2", 1.5, [[1, 1, 1], [0, 0]]),  # sums 1.27, 2.005
    ("seq_sum_k3", 2.0, [[0, 0, 0], [1, 1]]),  # sums 2.149, 1.140
    ("seq_mean_k1", 2.0, [[1, 1, 1], [0, 0]]),  # means -0.6, 1.05 vs [-0.69, 0.69]
    ("seq_mean_k2", 0.5, [[1, 1, 1], [0, 0]]),  # means 0.423, 1.0025
    ("seq_mean_k3", 0.6, [[0, 0, 0], [1, 1]]),  # means 0.716, 0.570
    ("seq_max_k2", 1.5, [[1, 1, 1], [0, 0]]),  # max 1.125, 2.0
    ("seq_max_k3", 1.5, [[0, 0, 0], [1, 1]]),  # max 1.98, 1.135
    ("token_k3,seq_max_k3", "0.2,1.5", [[0, 0, 0], [1, 0]]),  # every option must pass
    ("token_k3, seq_mean_k1,token_k3", "1.0,2.0", [[1, 1, 0], [0, 0]]),  # one threshold per option, duplicate dropped
]


def _padded(rows):
    return torch.tensor([row + [0] * (4 - len(row)) for row in rows]).float()


@pytest.mark.parametrize("rollout_rs, threshold, keep", REJECTION_CASES)
def test_each_rejection_option_by_hand(rollout_rs, threshold, keep):
    old, rollout = inputs()
    weights, kept, metrics = correct_rollout(old, rollout, MASK, rollout_rs=rollout_rs, rollout_rs_threshold=threshold)
    assert weights is None and torch.equal(kept.float(), _padded(keep))
    rejected = 1 - _padded(keep)[MASK.bool()].mean()
    assert metrics["rollout_corr/rollout_rs_masked_fraction"].item() == pytest.approx(rejected.item())


def test_rejection_metrics_by_hand():
    old, rollout = inputs()
    _, _, metrics = correct_rollout(
        old, rollout, MASK, rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="2.0,1.5"
    )
    expected = {
        "rollout_rs_token_k1_masked_fraction": 2 / 5,
        "rollout_rs_token_k1_seq_masked_fraction": 1.0,
        "rollout_rs_token_k1_max": 2.0,
        "rollout_rs_token_k1_min": -1.5,
        "rollout_rs_token_k1_mean": (-0.5 + 0.2 - 1.5 + 0.1 + 2.0) / 5,
        "rollout_rs_token_k1_fraction_high": 1 / 5,  # 2.0 > log 2
        "rollout_rs_token_k1_fraction_low": 1 / 5,  # -1.5 < -log 2
        "rollout_rs_seq_max_k3_masked_fraction": 3 / 5,
        "rollout_rs_seq_max_k3_seq_masked_fraction": 0.5,
        "rollout_rs_seq_max_k3_fraction_low": 0.0,
        "rollout_rs_masked_fraction": 4 / 5,
        "rollout_rs_seq_masked_fraction": 1.0,
    }
    for name, value in expected.items():
        assert metrics[f"rollout_corr/{name}"].item() == pytest.approx(value, abs=1e-6), name


RATIOS = [[math.exp(0.5), math.exp(-0.2), math.exp(1.5)], [math.exp(-0.1), math.exp(-2.0)]]


def test_tis_and_icepop_thresholds():
    old, rollout = inputs()
    tis, _, metrics = correct_rollout(old, rollout, MASK, rollout_is="token", rollout_is_threshold=2.0)
    torch.testing.assert_close(tis, _padded([[RATIOS[0][0], RATIOS[0][1], 2.0], RATIOS[1]]))
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"].item() == pytest.approx(1 / 5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_low"].item() == pytest.approx(1 / 5)  # 0.135 < 1/2
    # IcePop "0.5_2.0": ratios outside [0.5, 2] get weight 0 (not cut to the bound); the mask is untouched.
    icepop, kept, metrics = correct_rollout(old, rollout, MASK, rollout_is="token", rollout_is_threshold="0.5_2.0")
    torch.testing.assert_close(icepop, _padded([[RATIOS[0][0], RATIOS[0][1], 0.0], [RATIOS[1][0], 0.0]]))
    assert torch.equal(kept, MASK) and metrics["rollout_corr/rollout_is_oob_ratio"].item() == pytest.approx(2 / 5)
    seq, _, _ = correct_rollout(old, rollout, MASK, rollout_is="sequence", rollout_is_threshold="0.2_7.0")
    torch.testing.assert_close(seq, _padded([[math.exp(1.8)] * 3, [0.0, 0.0]]))  # exp(-2.1) = 0.12 < 0.2


def test_batch_normalisation_gives_mean_one():
    old, rollout = inputs()
    token, _, metrics = correct_rollout(
        old, rollout, MASK, rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True
    )
    mean = (RATIOS[0][0] + RATIOS[0][1] + 2.0 + sum(RATIOS[1])) / 5
    torch.testing.assert_close(token, _padded([[RATIOS[0][0], RATIOS[0][1], 2.0], RATIOS[1]]) / mean)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"].item() == pytest.approx(mean)
    assert metrics["rollout_corr/rollout_is_mean"].item() == pytest.approx(mean)  # before normalising, as verl
    # sequence: the mean over sequences (5 and exp(-2.1)), not over tokens.
    seq, _, _ = correct_rollout(
        old, rollout, MASK, rollout_is="sequence", rollout_is_threshold=5.0, rollout_is_batch_normalize=True
    )
    seq_mean = (5.0 + math.exp(-2.1)) / 2
    torch.testing.assert_close(seq, _padded([[5.0] * 3, [math.exp(-2.1)] * 2]) / seq_mean)


@pytest.mark.parametrize("kwargs, message", [
    ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "1.5,0.1,0.2"}, "3 thresholds for 2"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2.0"}, "single upper bound"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2.0_0.5"}, "lower bound above its upper"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": 0.5}, "lower bound above its upper"),  # L = 1/U = 2
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 1.0}, "seq_max_k1"),
    ({"rollout_rs": "token_k3", "rollout_rs_threshold": None}, "needs a threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "a_2"}, "not a number"),
    ({"rollout_is": "token", "rollout_is_threshold": True}, "must be a number"),
])  # fmt: skip
def test_bad_options_and_thresholds_are_refused(kwargs, message):
    old, rollout = inputs()
    with pytest.raises(ValueError, match=message):
        correct_rollout(old, rollout, MASK, **kwargs)


def test_the_config_rules_accept_what_the_parser_accepts():
    """dsrl.config (no torch) mirrors the parser's grammar, adding that an exactly on-policy ratio 1 is kept."""
    from dsrl.config.rules.rollout import _threshold_problem

    for spec in (2.0, "2.0", "0.5_5.0", 1.5, "1_3.0", "0.2_1.0", "1.0_1.0"):
        assert _threshold_problem(spec, "is") is None and parse_is_threshold(spec)
        assert _threshold_problem(spec, "k1") is None and parse_rs("token_k1", spec)
    for spec in (0.01, "0.5", 3):
        assert _threshold_problem(spec, "k") is None and parse_rs("token_k3", spec)
    for spec in ("x", "0.5_a", "-1", "0_2.0", True, "2.0_0.5"):
        assert _threshold_problem(spec, "is") is not None
        with pytest.raises(ValueError):
            parse_is_threshold(spec)
    assert _threshold_problem("0.5_2.0", "k") is not None
    with pytest.raises(ValueError):
        parse_rs("token_k3", "0.5_2.0")


# ---------------------------------------------------------------------------------------------
# the bypass_mode policy loss

# One response of two tokens; the rollout's log-probs stand in for the old ones: ratios exp(0.5) and 1.
LOG_PROBS = torch.tensor([[-1.0, -2.0]])
ROLLOUT = torch.tensor([[-1.5, -2.0]])
ONES = torch.ones(1, 2)


def bypass(corr, agg="token-mean", advantages=ONES, **kwargs):
    log_probs = LOG_PROBS.clone().requires_grad_()
    loss, metrics = policy_loss(
        "bypass_mode", old_log_probs=ROLLOUT, log_probs=log_probs, advantages=advantages, response_mask=ONES,
        loss_agg_mode=agg, clip_ratio_low=0.2, clip_ratio_high=0.2, rollout_correction=corr, **kwargs,
    )  # fmt: skip
    loss.backward()
    return loss.item(), log_probs.grad, metrics


def test_bypass_reinforce_weights_the_log_prob_by_the_truncated_ratio():
    w = math.exp(0.5)
    loss, grad, metrics = bypass({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 2.0})
    assert loss == pytest.approx(-(w * -1.0 + 1.0 * -2.0) / 2)  # -A w log pi, token-mean
    torch.testing.assert_close(grad, torch.tensor([[-w / 2, -0.5]]))  # w is a constant
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-0.25)  # mean(log pi_rollout - log pi)
    # without rollout_is: plain REINFORCE; truncated at 1.2 the first weight is 1.2
    assert bypass({"loss_type": "reinforce"})[0] == pytest.approx(1.5)
    assert bypass({"loss_type": "reinforce", "rollout_is": "token", "rollout_is_threshold": 1.2})[0] == pytest.approx(
        1.6
    )


def test_bypass_ppo_clip_clips_the_ratio_to_the_rollout_and_rejection_shrinks_the_mask():
    loss, grad, metrics = bypass({})  # ppo_clip by default: r = exp(0.5) clipped to 1.2, r = 1
    assert loss == pytest.approx((-1.2 - 1.0) / 2)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5]]))
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    # IS weights are not applied to ppo_clip (the ratio already corrects)
    assert bypass({"rollout_is": "token", "rollout_is_threshold": 1.1})[0] == pytest.approx(loss)
    # token_k1 "0.8_1.25" rejects the first token; the mini-batch normaliser (2 tokens) stays
    corr = {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.8_1.25"}
    assert bypass(corr, num_tokens=2)[0] == pytest.approx(-1.0 / 2)
    # seq-mean-token-mean: the response's length is its kept tokens
    assert bypass(corr, agg="seq-mean-token-mean", num_seqs=1)[0] == pytest.approx(-1.0)
    assert bypass({}, agg="seq-mean-token-mean", num_seqs=1)[0] == pytest.approx((-1.2 - 1.0) / 2)


def test_bypass_settings_merge_over_the_defaults_and_unknown_ones_are_refused():
    assert policy_loss_params("bypass_mode")["rollout_correction"]["loss_type"] == "ppo_clip"
    with pytest.raises(ValueError, match="no key rollout_rs_threshold_lower; its keys: loss_type, rollout_is"):
        bypass({"rollout_rs_threshold_lower": 0.5})
    with pytest.raises(ValueError, match="loss_type 'pg'.*ppo_clip, reinforce"):
        bypass({"loss_type": "pg"})
    _, _, metrics = bypass({"rollout_is": "sequence"})
    assert metrics["rollout_corr/rollout_is_mean"].item() == pytest.approx(math.exp(0.5))
    assert metrics["rollout_corr/kl"].item() == pytest.approx(-0.25)
