"""KL estimators, the in-reward KL penalty and the KL-coefficient controllers."""

import math

import pytest
import torch

from dsrl.algorithms import KL_KINDS, AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty

LN2 = math.log(2.0)
LOG_PROBS = torch.tensor([[0.0, -LN2]])
REF = torch.tensor([[-LN2, 0.0]])  # d = log π - log π_ref = [ln 2, -ln 2]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("kl", [LN2, -LN2]),
        ("k1", [LN2, -LN2]),
        ("abs", [LN2, LN2]),
        ("mse", [LN2**2 / 2, LN2**2 / 2]),
        ("k2", [LN2**2 / 2, LN2**2 / 2]),
        # exp(-d) + d - 1
        ("low_var_kl", [0.5 + LN2 - 1, 2.0 - LN2 - 1]),
        ("k3", [0.5 + LN2 - 1, 2.0 - LN2 - 1]),
    ],
)
def test_kl_values_by_hand(kind, expected):
    torch.testing.assert_close(kl_penalty(LOG_PROBS, REF, kind), torch.tensor([expected]))


@pytest.mark.parametrize("base", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_plus_forms_have_the_base_value_and_the_k2_gradient(base):
    gen = torch.Generator().manual_seed(0)
    ref = -torch.rand(3, 5, generator=gen) * 3
    log_probs = (ref + torch.randn(3, 5, generator=gen)).requires_grad_()
    value = kl_penalty(log_probs, ref, base + "+")
    torch.testing.assert_close(value, kl_penalty(log_probs, ref, base))
    (grad,) = torch.autograd.grad(value.sum(), log_probs)
    torch.testing.assert_close(grad, (log_probs - ref).detach())  # d(½ d²)/d log π = d


def test_k3_gradient_differs_from_k2_without_plus():
    log_probs = torch.tensor([0.5], requires_grad=True)
    (grad,) = torch.autograd.grad(kl_penalty(log_probs, torch.tensor([0.0]), "k3").sum(), log_probs)
    assert grad.item() == pytest.approx(1.0 - math.exp(-0.5))  # not d = 0.5


def test_k3_is_clamped_for_huge_log_ratios():
    # d' = ref - log π clamps to ∓20: exp(-20) + 20 - 1 = 19 and exp(20) - 21, both clamp to 10
    out = kl_penalty(torch.tensor([0.0, -60.0]), torch.tensor([-60.0, 0.0]), "low_var_kl")
    assert out.tolist() == [10.0, 10.0]


def test_full_kl_is_refused_with_a_reason():
    for kind in ("full", "full+"):
        with pytest.raises(ValueError, match="full vocabulary distributions.*low_var_kl"):
            kl_penalty(LOG_PROBS, REF, kind)


def test_unknown_kind_lists_the_valid_kinds():
    with pytest.raises(ValueError, match="unknown KL kind 'k4'") as error:
        kl_penalty(LOG_PROBS, REF, "k4")
    assert ", ".join(KL_KINDS) in str(error.value)
    assert list(KL_KINDS) == sorted(KL_KINDS) and "low_var_kl+" in KL_KINDS


def test_apply_kl_penalty_by_hand():
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.tensor([[0.0, -1.0, 5.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-0.5, -1.0, 0.0], [-2.0, -1.0, 0.0]])
    rewards, current_kl = apply_kl_penalty(scores, old, ref, mask, kind="kl", kl_coef=0.1)
    # kl · mask = [[0.5, 0, 0], [1, 0, -1]]
    torch.testing.assert_close(rewards, scores - 0.1 * torch.tensor([[0.5, 0.0, 0.0], [1.0, 0.0, -1.0]]))
    assert current_kl.item() == pytest.approx((0.5 / 2 + 0.0 / 3) / 2)


def test_adaptive_kl_controller_by_hand():
    controller = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    controller.update(current_kl=0.1, n_steps=10)  # error clipped to +0.2
    assert controller.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    value = controller.value
    controller.update(current_kl=0.05, n_steps=10)  # on target
    assert controller.value == pytest.approx(value)
    controller.update(current_kl=0.0, n_steps=50)  # error clipped to -0.2
    assert controller.value == pytest.approx(value * (1 - 0.2 * 50 / 100))
    controller.update(current_kl=torch.tensor(0.055), n_steps=100)  # a tensor works; error 0.1
    assert controller.value == pytest.approx(value * 0.9 * 1.1)


def test_adaptive_kl_controller_rejects_a_non_positive_horizon():
    with pytest.raises(ValueError, match="horizon must be > 0; got 0"):
        AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=0)


def test_fixed_kl_controller_never_changes():
    controller = FixedKLController(kl_coef=0.02)
    controller.update(current_kl=10.0, n_steps=1000)
    assert controller.value == 0.02
