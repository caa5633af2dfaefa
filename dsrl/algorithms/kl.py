"""KL estimators between the policy and the reference, and the KL-coefficient controllers.

Per-token estimators of KL(π || π_ref) from the log-probs of the sampled tokens
(J. Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html), with d = log π - log π_ref:

    kl,  k1          d
    abs              |d|
    mse, k2          d² / 2
    low_var_kl, k3   clamp(exp(-d') + d' - 1, -10, 10),  d' = clamp(d, -20, 20)   (unbiased, ≥ 0)

A `+` suffix (`k1+`, `low_var_kl+`, ...) keeps the value of the base kind but takes the gradient
of k2 (straight-through), whose expected gradient is the gradient of the KL; k1 and k3 are
unbiased in value but not in gradient.
"""

from __future__ import annotations

import torch

from dsrl.algorithms.tensor_ops import masked_mean

Tensor = torch.Tensor

_BASE_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_KINDS = tuple(sorted(_BASE_KINDS + tuple(kind + "+" for kind in _BASE_KINDS)))


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of kind `kind` (see the module docstring for the formulas).

    Args:
        log_probs: `[B, T]` log-probs of the sampled tokens under the policy.
        ref_log_probs: `[B, T]` the same under the reference.
        kind: one of `KL_KINDS`.
    Returns:
        `[B, T]`; differentiable with respect to `log_probs`.
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base == "full":
        raise ValueError(
            f"KL kind {kind!r} needs the full vocabulary distributions of both models, which dsrl "
            "never keeps; use 'low_var_kl' (k3) or 'kl' (k1), optionally with '+' for k2 gradients"
        )
    if base not in _BASE_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    value = _kl_value(log_probs, ref_log_probs, base)
    if not straight_through or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (log_probs - ref_log_probs).square()
    return k2 - k2.detach() + value.detach()


def _kl_value(log_probs: Tensor, ref_log_probs: Tensor, base: str) -> Tensor:
    if base in ("kl", "k1"):
        return log_probs - ref_log_probs
    if base == "abs":
        return (log_probs - ref_log_probs).abs()
    if base in ("mse", "k2"):
        return 0.5 * (log_probs - ref_log_probs).square()
    # k3: the clamps keep exp() finite and bound the rare huge values a bf16 mismatch produces.
    log_ratio = torch.clamp(ref_log_probs - log_probs, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, min=-10.0, max=10.0)


def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    *,
    kind: str,
    kl_coef: float,
) -> tuple[Tensor, Tensor]:
    """KL penalty in the reward (`algorithm.use_kl_in_reward`), as in verl and InstructGPT.

        kl = kl_penalty(old_log_probs, ref_log_probs, kind) · m
        token_level_rewards = token_level_scores - β · kl            (β = kl_coef)
        current_kl = mean_i (Σ_t kl_it / ℓ_i)                         (per-sequence mean, then batch mean)

    Args:
        token_level_scores, old_log_probs, ref_log_probs, response_mask: `[B, T]`.
        kind: a KL kind (see `kl_penalty`).
        kl_coef: β, the controller's current `value`.
    Returns:
        `(token_level_rewards [B, T], current_kl)`; feed `current_kl` (a scalar tensor) to the
        KL controller's `update` and log it as `actor/reward_kl_penalty`.
    """
    kl = kl_penalty(old_log_probs, ref_log_probs, kind) * response_mask
    token_level_rewards = token_level_scores - kl_coef * kl
    current_kl = masked_mean(kl, response_mask, dim=-1).mean()
    return token_level_rewards, current_kl


class FixedKLController:
    """A constant KL coefficient: `value` never changes."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so both controllers are used the same way."""


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593).

    After each step: e = clip(current_kl / target_kl - 1, -0.2, 0.2),
    value <- value · (1 + e · n_steps / horizon).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController horizon must be > 0; got {horizon}. Set kl_ctrl.horizon")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move `value` towards the target after `n_steps` samples with mean KL `current_kl`."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
