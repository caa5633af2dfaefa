"""Rollout correction: importance weights between the rollout engine and the trainer.

The rollout engine (vLLM in bf16, other kernels, sometimes a stale copy of the weights) samples
from ``π_rollout``; the trainer's loss assumes ``π_old``, the actor's own forward on the same
tokens. The per-token ratio

    ρ_t = π_old(y_t) / π_rollout(y_t) = exp(old_log_probs_t - rollout_log_probs_t)

corrects for that mismatch (Yao et al., 2025, "Your efficient RL framework secretly brings you
off-policy RL training"; Liu et al., 2025, "When speed kills stability"). Two ways to use it,
named as in verl's ``algorithm.rollout_correction`` and combinable:

- truncated importance sampling (``rollout_is``): the loss of token t is multiplied by
  ``min(ρ, rollout_is_threshold)`` (TIS), with ρ taken per token (``token``: ρ_t) or per sequence
  (``sequence``: ρ_seq = exp(Σ_t log ρ_t), the same weight on every token of the response);
- rejection (``rollout_rs``): tokens (``token``) or whole responses (``sequence``) whose ratio lies
  outside ``[rollout_rs_threshold_lower, rollout_rs_threshold]`` get weight 0. They still count in
  the loss normaliser (verl drops them from the response mask instead, which would also shrink the
  denominator of a token-mean).

Log-ratios are clamped to ±20 before ``exp`` so that a wildly wrong token gives a large finite
ratio rather than inf (the truncation or the rejection then deals with it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsrl.algorithms.tensor_ops import masked_sum

ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
_LOG_RATIO_BOUND = 20.0  # exp(20) ≈ 5e8: finite, and far beyond any useful threshold


@dataclass
class RolloutCorrection:
    """The result of ``rollout_correction``; every tensor ``[B, T]`` float32, detached."""

    weights: Tensor  # multiply the per-token loss: truncated ratio (or 1) times keep_mask; 0 on padding
    keep_mask: Tensor  # 1 on response tokens that stay in the loss, 0 on rejected ones and on padding
    ratio: Tensor  # the untruncated ratio at the IS level (token level when rollout_is is None); 0 on padding


def _ratio(log_ratio: Tensor, response_mask: Tensor, level: str) -> Tensor:
    """ρ at ``level`` broadcast over ``[B, T]``: ``exp(clamp(log ρ_t))`` or ``exp(clamp(Σ_t log ρ_t))``."""
    if level == "token":
        return log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()
    sequence = masked_sum(log_ratio, response_mask, dim=-1).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    return sequence.exp()[:, None].expand_as(log_ratio)


def _check_level(name: str, level: str | None) -> None:
    if level is not None and level not in ROLLOUT_CORRECTION_LEVELS:
        raise ValueError(f"{name}={level!r}: must be null or one of {', '.join(ROLLOUT_CORRECTION_LEVELS)}")


@torch.no_grad()
def rollout_correction(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | None = None,
    rollout_rs_threshold_lower: float | None = None,
) -> RolloutCorrection:
    """Truncated importance weights and rejection mask from the rollout engine to the trainer.

        log ρ_t = old_log_probs_t - rollout_log_probs_t            (on response tokens)
        ρ       = exp(clamp(log ρ_t, ±20))                        (rollout_is / rollout_rs = token)
                = exp(clamp(Σ_t log ρ_t, ±20)) on every token     (= sequence)
        keep    = [lower <= ρ_rs <= upper] · response_mask        (1 everywhere when rollout_rs is None)
        weights = min(ρ_is, rollout_is_threshold) · keep          (keep alone when rollout_is is None)

    ``upper`` is ``rollout_rs_threshold`` (default: ``rollout_is_threshold``), ``lower`` is
    ``rollout_rs_threshold_lower`` (default: ``1 / upper``).

    Args:
        old_log_probs: ``[B, T]`` the actor's log-probs of the sampled tokens (before the update).
        rollout_log_probs: ``[B, T]`` the rollout engine's log-probs of the same tokens.
        response_mask: ``[B, T]`` 1 on response tokens, 0 on padding.
        rollout_is: ``None`` (no weights), ``"token"`` or ``"sequence"``.
        rollout_is_threshold: upper truncation of the IS weight (TIS), > 0.
        rollout_rs: ``None`` (no rejection), ``"token"`` or ``"sequence"``.
        rollout_rs_threshold, rollout_rs_threshold_lower: the accepted ratio interval.
    Returns:
        ``RolloutCorrection(weights, keep_mask, ratio)``, all ``[B, T]`` float32; ``weights`` goes to
        ``policy_loss(..., rollout_is_weights=...)`` and to OTB's ``EstimatorInputs``.
    """
    _check_level("rollout_is", rollout_is)
    _check_level("rollout_rs", rollout_rs)
    if rollout_is_threshold <= 0:
        raise ValueError(f"rollout_is_threshold={rollout_is_threshold}: must be > 0")
    mask = response_mask.float()
    # Padding may hold anything (0 for both, or garbage): it never enters a ratio.
    log_ratio = torch.where(mask.bool(), old_log_probs.float() - rollout_log_probs.float(), 0.0)

    keep = mask
    if rollout_rs is not None:
        upper = rollout_is_threshold if rollout_rs_threshold is None else rollout_rs_threshold
        lower = 1.0 / upper if rollout_rs_threshold_lower is None else rollout_rs_threshold_lower
        rs_ratio = _ratio(log_ratio, mask, rollout_rs)
        keep = mask * ((rs_ratio >= lower) & (rs_ratio <= upper)).float()

    ratio = _ratio(log_ratio, mask, rollout_is or "token") * mask
    weights = keep if rollout_is is None else ratio.clamp(max=rollout_is_threshold) * keep
    return RolloutCorrection(weights=weights, keep_mask=keep, ratio=ratio)
