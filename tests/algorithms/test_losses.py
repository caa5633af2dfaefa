"""Loss aggregation, policy losses and the value loss: hand-computed cases, split invariance, errors."""

import math

import pytest
import torch

from dsrl.algorithms import LOSS_AGG_MODES, agg_loss, policy_loss, policy_loss_names, register_policy_loss, value_loss
from dsrl.algorithms import losses as losses_module
from dsrl.algorithms.losses import policy_loss_params

# losses whose token choice is the micro-batch's (documented so): every other loss is split invariant
NOT_SPLIT_INVARIANT = ("bypass_mode", "clip_cov", "kl_cov")
BUILTIN_LOSSES = (
    "bypass_mode",
    "cispo",
    "clip_cov",
    "dppo_kl",
    "dppo_tv",
    "dro",
    "geo_mean",
    "gpg",
    "gspo",
    "kl_cov",
    "sapo",
    "vanilla",
)
PARAMS = {"dro": {"dro_beta": 0.1}}  # dro_beta has no default

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the third row is empty


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 3),
        ("token-sum", 7.0),
        ("seq-mean-token-sum", (3 + 4) / 2),  # the empty row does not count
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 + 4) / 2 / 3),  # / T
    ],
)
def test_agg_loss_by_hand(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_agg_loss_global_normalisers_and_dp_size():
    assert agg_loss(LOSS, MASK, "token-mean", num_tokens=14).item() == pytest.approx(0.5)
    assert agg_loss(LOSS, MASK, "token-mean", num_tokens=14, dp_size=2).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, MASK, "token-sum", dp_size=3).item() == pytest.approx(21.0)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum", num_seqs=7).item() == pytest.approx(1.0)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", num_seqs=7, loss_scale_factor=0.5).item() == 2.0
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean", num_seqs=11, dp_size=2).item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_agg_loss_refuses_rank_local_counts_with_several_ranks(mode):
    with pytest.raises(ValueError, match="dp_size=2 needs the global"):
        agg_loss(LOSS, MASK, mode, dp_size=2)


def test_agg_loss_ignores_masked_nan_and_rejects_unknown_modes():
    loss = LOSS.clone()
    loss[2, 0] = float("nan")
    loss[0, 2] = float("inf")
    for mode in LOSS_AGG_MODES:
        assert torch.isfinite(agg_loss(loss, MASK, mode))
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'token_mean'.*seq-mean-token-mean.*token-sum"):
        agg_loss(LOSS, MASK, "token_mean")


def test_vanilla_ppo_by_hand():
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    ratio = torch.tensor([[1.5, 0.5, 5.0, 1.0]])
    old = torch.log(torch.full((1, 4), 0.5))
    log_probs = (old + ratio.log()).requires_grad_()
    loss, metrics = policy_loss(
        "vanilla", old_log_probs=old, log_probs=log_probs, advantages=advantages, response_mask=torch.ones(1, 4)
    )
    # per token: max(-1.5, -1.2) = -1.2 | max(0.5, 0.8) = 0.8 | min(3, max(5, 1.2)) = 3 (dual) | -1
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 3.0 - 1.0) / 4)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-math.log(1.5 * 0.5 * 5.0) / 4)
    loss.backward()
    # clipped and dual-clipped tokens get no gradient; the last one d(-A r)/d log π / 4 = -1/4
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.0, 0.0, 0.0, -0.25]]))


def test_vanilla_asymmetric_clip_and_log_ratio_clamp():
    old = torch.zeros(1, 3)
    log_probs = torch.tensor([[math.log(1.25), math.log(1.3), 50.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0]])
    loss, _ = policy_loss(
        "vanilla",
        old_log_probs=old,
        log_probs=log_probs,
        advantages=advantages,
        response_mask=torch.ones(1, 3),
        loss_agg_mode="token-sum",
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=10.0,
    )
    # 1.25 is inside [0.8, 1.28]; 1.3 is clipped to 1.28; exp(50) clamps to exp(20), dual clip at 10
    assert loss.item() == pytest.approx(-1.25 - 1.28 + 10.0)


def test_vanilla_rejects_clip_ratio_c_not_above_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(
            "vanilla",
            old_log_probs=torch.zeros(1, 1),
            log_probs=torch.zeros(1, 1),
            advantages=torch.ones(1, 1),
            response_mask=torch.ones(1, 1),
            clip_ratio_c=1.0,
        )


def test_gspo_by_hand():
    old = torch.zeros(2, 2)
    log_probs = torch.tensor([[math.log(2.0), 0.0], [0.1, -0.1]], requires_grad=True)
    advantages = torch.ones(2, 2)
    loss, metrics = policy_loss(
        "gspo", old_log_probs=old, log_probs=log_probs, advantages=advantages, response_mask=torch.ones(2, 2)
    )
    # row 0: s = 2^(1/2) > 1.2, clipped -> -1.2 per token, no gradient; row 1: s = 1 -> -1, grad -s
    assert loss.item() == pytest.approx((-1.2 * 2 - 1.0 * 2) / 4)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["actor/pg_clipfrac_lower"].item() == 0.0
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]]))


def test_cispo_keeps_gradient_through_clipped_tokens():
    old = torch.log(torch.tensor([[0.2, 0.5]]))
    log_probs = torch.log(torch.tensor([[0.4, 0.5]])).requires_grad_()  # ratios 2 and 1
    advantages = torch.tensor([[1.0, -2.0]])
    loss, metrics = policy_loss(
        "cispo",
        old_log_probs=old,
        log_probs=log_probs,
        advantages=advantages,
        response_mask=torch.ones(1, 2),
        loss_agg_mode="token-sum",
    )
    # ℓ = -sg(clip(r)) A log π: -1.2 · 1 · log 0.4 and -1 · (-2) · log 0.5
    assert loss.item() == pytest.approx(-1.2 * math.log(0.4) + 2.0 * math.log(0.5))
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.2, 2.0]]))


def test_gpg_is_plain_policy_gradient_without_metrics():
    log_probs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, metrics = policy_loss(
        "gpg",
        old_log_probs=torch.zeros(1, 2),
        log_probs=log_probs,
        advantages=torch.tensor([[2.0, -1.0]]),
        response_mask=torch.ones(1, 2),
    )
    assert loss.item() == pytest.approx((2.0 - 2.0) / 2)
    assert metrics == {}
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.0, 0.5]]))


def _one_row(log_probs, advantages, old_log_probs=None, **options):
    """policy_loss over one row of len(log_probs) tokens, all valid; returns (loss, metrics, log_probs with grad)."""
    log_probs = torch.tensor([log_probs], requires_grad=True)
    old = torch.log(torch.full_like(log_probs, 0.5)) if old_log_probs is None else torch.tensor([old_log_probs])
    options.setdefault("loss_agg_mode", "token-sum")
    loss, metrics = policy_loss(
        options.pop("mode"),
        old_log_probs=old,
        log_probs=log_probs,
        advantages=torch.tensor([advantages]),
        response_mask=torch.ones_like(log_probs),
        **options,
    )
    return loss, metrics, log_probs


def test_dppo_tv_by_hand():
    # p_old = 0.5 everywhere; p = 0.6, 0.8, 0.4, 0.1: the change 0.1 and -0.1 stay inside 0.2, 0.3 (A > 0) and
    # -0.4 (A < 0) leave it. Ratios 1.2, 1.6, 0.8, 0.2; c = 1.1 truncates the first weight.
    probs = [0.6, 0.8, 0.4, 0.1]
    loss, metrics, log_probs = _one_row(
        [math.log(p) for p in probs], [1.0, 1.0, -1.0, -1.0], mode="dppo_tv", clip_ratio_c=1.1
    )
    # ℓ = -A · sg[min(r, c)] · log p · v: -1.1 log 0.6 | 0 | 0.8 log 0.4 | 0
    assert loss.item() == pytest.approx(-1.1 * math.log(0.6) + 0.8 * math.log(0.4))
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(0.25)  # 1.6 > c too, but untrusted
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-math.log(1.2 * 1.6 * 0.8 * 0.2) / 4)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.1, 0.0, 0.8, 0.0]]))


def test_dppo_kl_limits_only_a_move_in_the_advantages_direction():
    # p_old = 0.5. D(p) = 0.5 log(0.5 / p) + 0.5 log(0.5 / (1 - p)):
    # p = 0.6: D = 0.5 log(5/6) + 0.5 log(5/4) = 0.0204 <= 0.2, trusted
    # p = 0.95 (A > 0): D = 0.5 log(10/19) + 0.5 log(10) = 0.830 > 0.2, untrusted
    # p = 0.1 (A > 0): a move against the advantage, trusted whatever D (0.511)
    # p = 0.05 (A < 0): D = 0.830 > 0.2 and p < p_old, untrusted
    probs = [0.6, 0.95, 0.1, 0.05]
    loss, metrics, log_probs = _one_row([math.log(p) for p in probs], [1.0, 1.0, 1.0, -1.0], mode="dppo_kl")
    assert loss.item() == pytest.approx(-1.2 * math.log(0.6) - 0.2 * math.log(0.1))
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.2, 0.0, -0.2, 0.0]]))


def test_sapo_by_hand_always_seq_mean_token_mean():
    old = torch.zeros(2, 2)
    log_probs = torch.zeros(2, 2, requires_grad=True)  # r = 1: the gate is (4/τ)·σ(0) = 2/τ
    advantages = torch.tensor([[1.0, -1.0], [1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    for agg_mode in LOSS_AGG_MODES:  # not read
        loss, metrics = policy_loss(
            "sapo",
            old_log_probs=old,
            log_probs=log_probs,
            advantages=advantages,
            response_mask=mask,
            loss_agg_mode=agg_mode,
            tau_pos=1.0,
            tau_neg=2.0,
        )
        # ℓ = -A·2/τ: row 0 (-2 + 1)/2 = -0.5, row 1 -2; the mean of the rows
        assert loss.item() == pytest.approx((-0.5 - 2.0) / 2)
    assert metrics["actor/pg_clipfrac"].item() == 0.0 and metrics["actor/pg_clipfrac_lower"].item() == 0.0
    loss.backward()
    # dℓ/dlog π = -A · 4σ(1 - σ) · r = -A at r = 1, then / ℓ_i / N_seq
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.25, 0.25], [-0.5, 0.0]]))


# p_old = 0.5; ratios 1, 1, 1.1, 0.9, none clipped at 0.2; mean A = 0, mean log p = -0.69566, so
# cov = A·(log p + 0.69566) = 0.0025, -0.0025, 0.0978, 0.1028.
COV_PROBS = [math.log(0.5), math.log(0.5), math.log(0.55), math.log(0.45)]
COV_ADVANTAGES = [1.0, -1.0, 1.0, -1.0]


def test_clip_cov_cuts_the_tokens_with_covariance_in_bounds():
    loss, metrics, log_probs = _one_row(
        COV_PROBS, COV_ADVANTAGES, mode="clip_cov", clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=5.0
    )
    # tokens 2 and 3 lie in (0.05, 5), fewer than ⌊1.0 · 4⌋: both cut; -1 + 1 remain
    assert loss.item() == pytest.approx(0.0)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.5)
    assert set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl"}
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.0, 1.0, 0.0, 0.0]]))


def test_clip_cov_draws_its_tokens_from_the_global_generator():
    def cut_tokens():
        loss, _, log_probs = _one_row(COV_PROBS, COV_ADVANTAGES, mode="clip_cov", clip_cov_ratio=0.25, clip_cov_lb=0.05)
        loss.backward()
        return (log_probs.grad == 0).squeeze(0).tolist()

    draws = set()
    for seed in range(8):
        torch.manual_seed(seed)
        first = cut_tokens()
        torch.manual_seed(seed)
        assert cut_tokens() == first  # the same seed, the same token
        assert sum(first) == 1 and first[2] or first[3]  # ⌊0.25 · 4⌋ = 1 of the two candidates
        draws.add(tuple(first))
    assert len(draws) == 2


def test_clip_cov_never_cuts_a_clipped_token():
    # token 2's ratio 1.5 is clipped (A > 0): its covariance is the largest, it is no candidate. Mean log p = -0.618,
    # cov = -0.075, 0.075, 0.330, 0.180: token 3 is the only other one above 0.1
    probs = [math.log(0.5), math.log(0.5), math.log(0.75), math.log(0.45)]
    loss, metrics, log_probs = _one_row(probs, COV_ADVANTAGES, mode="clip_cov", clip_cov_ratio=1.0, clip_cov_lb=0.1)
    loss.backward()
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.25)
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.0, 1.0, 0.0, 0.0]]))
    assert loss.item() == pytest.approx(-1.0 + 1.0 - 1.2)


def test_kl_cov_penalises_the_top_covariance_tokens():
    loss, metrics, log_probs = _one_row(COV_PROBS, COV_ADVANTAGES, mode="kl_cov", kl_cov_ratio=0.25, ppo_kl_coef=0.1)
    # ⌊0.25 · 4⌋ = 1 token, the largest cov (token 3, r = 0.9): ℓ = -A r + 0.1 |log 0.9|; no clip anywhere
    assert loss.item() == pytest.approx(-1.0 + 1.0 - 1.1 + 0.9 + 0.1 * -math.log(0.9))
    assert metrics == {"actor/ppo_kl": pytest.approx((math.log(1.1) - math.log(0.9)) / 4)}  # mean |log r|
    loss.backward()
    # d(-A r)/dlog π = -A r; d|log r| = sign(log r) = -1 at token 3
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.0, 1.0, -1.1, 0.9 - 0.1]]))


def test_geo_mean_by_hand():
    old = torch.zeros(2, 2)
    log_probs = torch.tensor([[math.log(1.5), 0.0], [-math.log(1.5), 0.1]], requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    weights = torch.tensor([[4.0, 1.0], [1.0, 1.0]])  # row 0: geometric mean 2
    loss, metrics = policy_loss(
        "geo_mean",
        old_log_probs=old,
        log_probs=log_probs,
        advantages=advantages,
        response_mask=torch.ones(2, 2),
        loss_agg_mode="token-sum",  # not read
        rollout_is_weights=weights,
    )
    # log-ratios clipped to [-0.2, 0.2] in the advantage's direction: row 0 (0.2, 0), row 1 (-0.2, 0.1)
    # L_0 = -1 · exp(0.1) · 2, L_1 = +1 · exp(-0.05); the mean of the rows
    assert loss.item() == pytest.approx((-2 * math.exp(0.1) + math.exp(-0.05)) / 2)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(0.25)
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(0.25)
    loss.backward()
    # clipped tokens get no gradient; the others d L_i / dδ = L_i / n_i, then / N_seq
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.0, -math.exp(0.1) / 2], [0.0, math.exp(-0.05) / 4]]))


def test_geo_mean_counts_only_non_empty_rows():
    kwargs = {"old_log_probs": torch.zeros(2, 2), "log_probs": torch.zeros(2, 2), "advantages": torch.ones(2, 2)}
    loss, _ = policy_loss("geo_mean", response_mask=torch.tensor([[1.0, 1.0], [0.0, 0.0]]), **kwargs)
    assert loss.item() == pytest.approx(-1.0)  # verl's mean over the rows would give -0.5


def test_dro_by_hand():
    loss, metrics, log_probs = _one_row([-1.0, -2.0], [1.0, -2.0], old_log_probs=[-1.5, -2.0], mode="dro", dro_beta=0.5)
    # ℓ = -(A log π - β/2 δ²): -(-1 - 0.25 · 0.25) = 1.0625 | -(4 - 0) = -4
    assert loss.item() == pytest.approx(1.0625 - 4.0)
    assert metrics == {"actor/ppo_kl": pytest.approx(-0.25)}
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.0 + 0.5 * 0.5, 2.0]]))


@pytest.mark.parametrize(
    ("mode", "params", "message"),
    [
        ("dro", {}, "dro needs dro_beta > 0.*got None"),
        ("dro", {"dro_beta": 0.0}, "dro needs dro_beta > 0.*got 0.0"),
        ("sapo", {"tau_neg": 0.0}, "SAPO's temperatures must be > 0.*tau_neg=0.0"),
        ("clip_cov", {"clip_cov_ratio": 0.0}, "clip_cov needs 0 < clip_cov_ratio <= 1"),
        ("clip_cov", {"clip_cov_lb": 5.0}, "clip_cov_lb < clip_cov_ub; got 0.0002, 5.0, 5.0"),
        ("kl_cov", {"kl_cov_ratio": 1.5}, "kl_cov needs 0 < kl_cov_ratio <= 1"),
        ("kl_cov", {"ppo_kl_coef": -0.1}, "ppo_kl_coef >= 0"),
        ("sapo", {"clip_cov_ratio": 0.1}, "'sapo' takes no parameter clip_cov_ratio; its parameters: tau_neg, tau_pos"),
    ],
)
def test_loss_parameters_out_of_range_are_refused(mode, params, message):
    with pytest.raises(ValueError, match=message):
        _one_row([-1.0, -2.0], [1.0, -1.0], mode=mode, **params)


def test_declared_parameters_and_defaults_are_verls():
    assert policy_loss_params("sapo") == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert policy_loss_params("clip_cov") == {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}
    assert policy_loss_params("kl_cov") == {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}
    assert policy_loss_params("dro") == {"dro_beta": None}
    assert all(policy_loss_params(name) == {} for name in ("vanilla", "dppo_tv", "dppo_kl", "geo_mean"))


@pytest.mark.parametrize("mode", BUILTIN_LOSSES)
def test_each_loss_documents_whether_it_is_split_invariant(mode):
    doc = " ".join(losses_module._POLICY_LOSSES[mode].fn.__doc__.split()).lower()
    assert "https://" in doc  # the paper (or, for bypass mode, the write-up) it implements
    if mode in NOT_SPLIT_INVARIANT:
        assert "not micro-batch-split invariant" in doc
        assert f"`{mode}`" in " ".join(losses_module.__doc__.split())  # the module docstring's exceptions
    elif mode not in ("vanilla", "gspo", "cispo", "gpg"):  # those follow the module docstring's rule
        assert "split invariant" in doc and "not micro-batch-split" not in doc


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo", "gpg", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "dro"])
def test_rollout_is_weights_multiply_the_per_token_loss(mode):
    gen = torch.Generator().manual_seed(0)
    kwargs = {
        "old_log_probs": -torch.rand(3, 4, generator=gen),
        "log_probs": -torch.rand(3, 4, generator=gen),
        "advantages": torch.randn(3, 4, generator=gen),
        "response_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]),
    }
    weights = torch.rand(3, 4, generator=gen) * 2
    clips = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    params = {**policy_loss_params(mode), **PARAMS.get(mode, {})}
    torch.manual_seed(0)  # clip_cov's draw: the same in both calls
    per_token, _ = losses_module._POLICY_LOSSES[mode].fn(**clips, **kwargs, **params)
    torch.manual_seed(0)
    weighted, _ = policy_loss(mode, loss_agg_mode="token-sum", rollout_is_weights=weights, **clips, **kwargs, **params)
    assert weighted.item() == pytest.approx((per_token * weights * kwargs["response_mask"]).sum().item())


@pytest.mark.parametrize("mode", sorted(set(BUILTIN_LOSSES) - {"gpg"}))
def test_metrics_are_detached_scalar_tensors_with_verl_names(mode):
    log_probs = torch.zeros(2, 3, requires_grad=True)
    _, metrics = policy_loss(
        mode,
        old_log_probs=torch.zeros(2, 3),
        log_probs=log_probs,
        advantages=torch.ones(2, 3),
        response_mask=torch.ones(2, 3),
        **PARAMS.get(mode, {}),
    )
    three = {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    fewer = {"clip_cov": {"actor/pg_clipfrac", "actor/ppo_kl"}, "kl_cov": {"actor/ppo_kl"}, "dro": {"actor/ppo_kl"}}
    assert {name for name in metrics if name.startswith("actor/")} == fewer.get(mode, three)
    # bypass_mode adds its diagnostics of the current policy against the rollout's
    assert all(name.startswith(("actor/", "rollout_corr/")) for name in metrics)
    assert any(name.startswith("rollout_corr/") for name in metrics) == (mode == "bypass_mode")
    for value in metrics.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad


def test_value_loss_by_hand():
    vpreds = torch.tensor([[1.2, 3.0, 2.0]], requires_grad=True)
    values = torch.tensor([[1.5, 1.5, 3.0]])
    returns = torch.tensor([[2.0, 2.0, 2.0]])
    loss, clipfrac = value_loss(vpreds, values, returns, torch.ones(1, 3), cliprange_value=0.5)
    # token 0 inside the clip range: 0.8²; token 1: max(1, (2 - 2)²) = 1; token 2: max(0, (2.5 - 2)²)
    assert loss.item() == pytest.approx(0.5 * (0.64 + 1.0 + 0.25) / 3)
    assert clipfrac.item() == pytest.approx(1 / 3) and not clipfrac.requires_grad
    loss.backward()
    # d/dv of 0.5·(v - R)² / 3 where the prediction term wins; zero where the clipped constant wins
    torch.testing.assert_close(vpreds.grad, torch.tensor([[-0.8 / 3, 1 / 3, 0.0]]))


# ---------------------------------------------------------------------------------------------
# split invariance: micro-batches (and ranks) with global normalisers sum to the whole batch


def _batch(seed=0, rows=8, width=6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    lengths[0] = width
    mask = (torch.arange(width) < lengths.unsqueeze(-1)).float()
    return gen, mask


def _global_normalisers(mask):
    return {"num_tokens": mask.sum(), "num_seqs": (mask.sum(-1) > 0).sum(), "loss_scale_factor": mask.shape[-1]}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_micro_batches_sum_to_the_whole_batch(mode):
    gen, mask = _batch()
    loss_mat = torch.randn(mask.shape, generator=gen, requires_grad=True)
    norm = _global_normalisers(mask)
    whole = agg_loss(loss_mat, mask, mode)
    whole_grad = torch.autograd.grad(whole, loss_mat)[0]
    split = sum(agg_loss(loss_mat[rows], mask[rows], mode, **norm) for rows in (slice(0, 3), slice(3, 4), slice(4, 8)))
    split_grad = torch.autograd.grad(split, loss_mat)[0]
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(split_grad, whole_grad)


@pytest.mark.parametrize("loss_mode", sorted(set(BUILTIN_LOSSES) - set(NOT_SPLIT_INVARIANT)))
@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
def test_policy_loss_gradient_is_the_same_for_any_split_and_rank_count(loss_mode, agg_mode):
    gen, mask = _batch(seed=1)
    old = -torch.rand(mask.shape, generator=gen) * 2
    log_probs = (old + 0.3 * torch.randn(mask.shape, generator=gen)).requires_grad_()
    advantages = torch.randn(mask.shape, generator=gen)
    weights = torch.rand(mask.shape, generator=gen) + 0.5

    def loss(rows, **norm):
        return policy_loss(
            loss_mode,
            old_log_probs=old[rows],
            log_probs=log_probs[rows],
            advantages=advantages[rows],
            response_mask=mask[rows],
            loss_agg_mode=agg_mode,
            rollout_is_weights=weights[rows],
            **PARAMS.get(loss_mode, {}),
            **norm,
        )[0]

    whole_grad = torch.autograd.grad(loss(slice(None)), log_probs)[0]
    norm = _global_normalisers(mask)
    micro_grad = torch.autograd.grad(sum(loss(r, **norm) for r in (slice(0, 5), slice(5, 8))), log_probs)[0]
    torch.testing.assert_close(micro_grad, whole_grad)
    # two ranks, each with two micro-batches; the engine averages the ranks' gradients
    ranks = ((slice(0, 2), slice(2, 4)), (slice(4, 7), slice(7, 8)))
    rank_grads = [torch.autograd.grad(sum(loss(r, dp_size=2, **norm) for r in micro), log_probs)[0] for micro in ranks]
    torch.testing.assert_close((rank_grads[0] + rank_grads[1]) / 2, whole_grad)


@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
def test_value_loss_gradient_is_the_same_for_any_split(agg_mode):
    gen, mask = _batch(seed=2)
    vpreds = torch.randn(mask.shape, generator=gen, requires_grad=True)
    values, returns = torch.randn(mask.shape, generator=gen), torch.randn(mask.shape, generator=gen)
    whole, _ = value_loss(vpreds, values, returns, mask, cliprange_value=0.2, loss_agg_mode=agg_mode)
    norm = _global_normalisers(mask)
    split = sum(
        value_loss(vpreds[r], values[r], returns[r], mask[r], cliprange_value=0.2, loss_agg_mode=agg_mode, **norm)[0]
        for r in (slice(0, 1), slice(1, 8))
    )
    torch.testing.assert_close(torch.autograd.grad(split, vpreds)[0], torch.autograd.grad(whole, vpreds)[0])


# ---------------------------------------------------------------------------------------------
# registry


def test_policy_loss_registry_names_and_errors():
    assert policy_loss_names() == list(BUILTIN_LOSSES)
    with pytest.raises(
        ValueError, match="unknown policy loss 'ppo'; valid names: bypass_mode, cispo, clip_cov, .*, vanilla"
    ):
        policy_loss(
            "ppo",
            old_log_probs=torch.zeros(1, 1),
            log_probs=torch.zeros(1, 1),
            advantages=torch.ones(1, 1),
            response_mask=torch.ones(1, 1),
        )
    with pytest.raises(ValueError, match="'vanilla' is already registered"):
        register_policy_loss("vanilla")(lambda **_: (torch.zeros(1, 1), {}))


def test_a_registered_policy_loss_is_weighted_and_aggregated():
    register_policy_loss("test_log_prob")(lambda *, log_probs, **_: (-log_probs, {}))
    try:
        log_probs = torch.tensor([[-1.0, -3.0]])
        loss, _ = policy_loss(
            "test_log_prob",
            old_log_probs=log_probs,
            log_probs=log_probs,
            advantages=torch.ones(1, 2),
            response_mask=torch.ones(1, 2),
            rollout_is_weights=torch.tensor([[1.0, 2.0]]),
        )
        assert loss.item() == pytest.approx((1.0 + 6.0) / 2)
    finally:
        losses_module._POLICY_LOSSES.pop("test_log_prob")


def test_a_registered_loss_declares_parameters_and_refuses_others():
    register_policy_loss("test_scaled", params={"scale": 2.0})(
        lambda *, log_probs, scale, **_: (-scale * log_probs, {})
    )
    try:
        kwargs = {
            "old_log_probs": torch.zeros(1, 2),
            "log_probs": torch.tensor([[-1.0, -3.0]]),
            "advantages": torch.ones(1, 2),
            "response_mask": torch.ones(1, 2),
        }
        assert losses_module.policy_loss_params("test_scaled") == {"scale": 2.0}
        assert policy_loss("test_scaled", **kwargs)[0].item() == pytest.approx(4.0)  # the default
        assert policy_loss("test_scaled", scale=0.5, **kwargs)[0].item() == pytest.approx(1.0)
        with pytest.raises(ValueError, match="'test_scaled' takes no parameter tau_pos; its parameters: scale"):
            policy_loss("test_scaled", tau_pos=1.0, **kwargs)
        with pytest.raises(ValueError, match="'vanilla' takes no parameter scale; its parameters: none"):
            policy_loss("vanilla", scale=1.0, **kwargs)
        with pytest.raises(ValueError, match="'test_clash' declares clip_ratio_c, dp_size, which every loss is given"):
            register_policy_loss("test_clash", params={"clip_ratio_c": 2.0, "dp_size": 1})
    finally:
        losses_module._POLICY_LOSSES.pop("test_scaled")


def test_a_self_aggregating_loss_gets_the_normalisers_and_the_weights():
    seen = {}

    def sequence_loss(*, log_probs, response_mask, rollout_is_weights, num_seqs, dp_size, loss_agg_mode, **_):
        seen.update(mode=loss_agg_mode, weights=rollout_is_weights, dp_size=dp_size)
        return -(log_probs * response_mask).sum() / num_seqs * dp_size, {"actor/x": log_probs.sum()}

    register_policy_loss("test_sequence", aggregates=True)(sequence_loss)
    try:
        log_probs = torch.tensor([[-1.0, -3.0]], requires_grad=True)
        weights = torch.ones(1, 2)
        loss, metrics = policy_loss(
            "test_sequence",
            old_log_probs=torch.zeros(1, 2),
            log_probs=log_probs,
            advantages=torch.ones(1, 2),
            response_mask=torch.ones(1, 2),
            loss_agg_mode="seq-mean-token-sum",
            rollout_is_weights=weights,
            num_seqs=4,
            dp_size=2,
        )
        assert loss.item() == pytest.approx(2.0)  # not aggregated a second time
        assert seen == {"mode": "seq-mean-token-sum", "weights": weights, "dp_size": 2}
        assert not metrics["actor/x"].requires_grad
    finally:
        losses_module._POLICY_LOSSES.pop("test_sequence")
