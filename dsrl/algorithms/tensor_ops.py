"""Masked reductions, per-token quantities computed from logits, and the responses the length cap cut.

Every masked reduction in dsrl lives here. A mask is a `[B, T]` tensor of 0/1 (bool, integer or
float) marking the response tokens that count; positions where it is 0 never influence a result,
even when they hold NaN or inf (padding after a sequence's end, tool-output tokens in multi-turn).
Reductions return tensors and never synchronise with the device.
"""

from __future__ import annotations

import torch

_EPS_COUNT = 1e-8  # keeps a mean over an all-zero mask at 0 instead of NaN
_EPS_VAR = 1e-8  # keeps whitening finite when every masked value is equal


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values * mask`, with values outside the mask treated as 0 (NaN-safe).

    sum = Σ_i [mask_i ≠ 0] · values_i · mask_i

    Args:
        values: any shape, e.g. `[B, T]`.
        mask: same shape as `values`.
        dim: dimension to reduce; `None` reduces everything to a scalar.
    """
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(dim=dim)


def truncated_responses(
    response_ids: torch.Tensor, response_mask: torch.Tensor, *, max_response_length: int, eos_token_ids: list[int]
) -> torch.Tensor:
    """Which responses the rollout cut at ``max_response_length`` tokens: `[B]` bool, true where the
    response fills the whole budget and its last token is no EOS (the rollout's finish reason "length").

    Args:
        response_ids: `[B, T]`, right-padded.
        response_mask: `[B, T]` 0/1, 1 on the generated tokens, EOS included.
    """
    lengths = response_mask.sum(-1).long()  # [B]
    last = response_ids.gather(-1, (lengths - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B]
    ended = torch.isin(last, torch.tensor(eos_token_ids, dtype=last.dtype, device=last.device))
    return (lengths == max_response_length) & ~ended


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the masked elements.

    mean = masked_sum(values, mask) / (Σ mask + 1e-8)

    An all-zero mask gives 0. Shapes as in `masked_sum`.
    """
    return masked_sum(values, mask, dim) / (mask.sum(dim=dim) + _EPS_COUNT)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Whiten `values` with the mean and unbiased variance of the masked elements.

    μ = masked_mean(x, m),  σ² = masked_mean((x - μ)², m) · n / (n - 1),  n = Σ m
    out = (x - μ) · rsqrt(σ² + 1e-8)

    Every position is shifted and scaled, masked or not; multiply by the mask to zero the rest.
    Needs at least two masked elements (an error otherwise: the unbiased variance is undefined).

    Args:
        values: `[B, T]` (any shape works).
        mask: same shape, 0/1.
    Returns:
        a new tensor shaped like `values`.
    """
    finite = torch.where(mask.bool(), values, 0.0)  # statistics never see masked-out NaN / inf
    mean, var = _masked_mean_var(finite, mask.to(values.dtype), torch.empty_like(finite))
    return (values - mean) * torch.rsqrt(var + _EPS_VAR)


def masked_whiten_(values: torch.Tensor, mask: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """In-place `masked_whiten` for finite `values`: overwrites and returns `values`.

    `mask` must have the dtype of `values`; it may hold non-negative weights (counts) instead of
    0/1, e.g. a row-constant `[B, T]` tensor reduced to `[B]` with weights = row lengths gives the
    token-level statistics. `scratch`, a tensor shaped like `values` that may be overwritten,
    saves an allocation (the estimators whiten [B, T] tensors of tens of millions of elements,
    where fresh allocations dominate the run time).
    """
    mean, var = _masked_mean_var(values, mask, torch.empty_like(values) if scratch is None else scratch)
    return values.sub_(mean).mul_(torch.rsqrt(var + _EPS_VAR))


def _masked_mean_var(
    values: torch.Tensor, mask: torch.Tensor, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mean and unbiased variance of finite `values`; `scratch` is overwritten."""
    count = mask.sum()
    torch._assert_async(count > 1, "masked_whiten needs at least two masked elements (unbiased variance)")
    mean = torch.mul(values, mask, out=scratch).sum() / (count + _EPS_COUNT)
    torch.sub(values, mean, out=scratch).square_().mul_(mask)
    var = scratch.sum() / (count + _EPS_COUNT) * (count / (count - 1))
    return mean, var


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under softmax(logits).

    log π(y) = z_y - logsumexp(z)

    Computed in float32 at least (bf16 logsumexp loses several bits), without materialising the
    full log-softmax. Differentiable.

    Args:
        logits: `[..., V]`, e.g. `[B, T, V]`.
        labels: `[...]` int64 token ids, e.g. `[B, T]`.
    Returns:
        `[...]` float32 (float64 if the logits are float64).
    """
    logits = _at_least_float32(logits)
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) along the last dimension.

    H = logsumexp(z) - Σ_v softmax(z)_v · z_v

    Args:
        logits: `[..., V]`.
    Returns:
        `[...]`, float32 at least.
    """
    logits = _at_least_float32(logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Σ_v π_v² of softmax(logits), exactly and stably, via log-sum-exp.

    Σ π² = exp(logsumexp(2z) - 2 · logsumexp(z))

    Used by the optimal token baseline (`w_t = 1 - 2 π_t + Σ π²`).

    Args:
        logits: `[..., V]`.
    Returns:
        `[...]`, float32 at least.
    """
    logits = _at_least_float32(logits)
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()
