"""Policy losses (registered by name), the value loss, and the one loss aggregation `agg_loss`.

Semantics follow verl 0.9.1 `core_algos.py`, metric names included. Every loss returns a scalar
to call `backward()` on and detached tensor metrics (no host synchronisation, except where `clip_cov`
and `kl_cov` count or rank tokens on the host, as verl does).

Split invariance: a mini-batch is usually processed as several micro-batches (and ranks) whose
gradients are accumulated. Pass the mini-batch-wide normalisers (`num_tokens`, `num_seqs`, all
ranks and micro-batches) and `dp_size`, and the summed micro-batch losses equal the whole
mini-batch's loss, so any split gives the same gradient. Three losses are not split invariant, by
their definition: `clip_cov` and `kl_cov` choose tokens by their covariance centred on the
micro-batch's means, as many as a ratio of the micro-batch's tokens (`clip_cov` at random), and
`bypass_mode` corrects against the current policy (after each optimizer step of an epoch) and may
normalise its weights over the micro-batch. As in verl, these are computed per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dsrl.algorithms.rollout_correction import correct_rollout
from dsrl.algorithms.tensor_ops import masked_mean, masked_sum

Tensor = torch.Tensor
PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

_LOG_RATIO_CLAMP = 20.0  # exp() of a larger log-ratio overflows float32 / bf16 gradients
_GSPO_LOG_RATIO_MAX = 10.0


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: Tensor | int | None = None,
    num_seqs: Tensor | int | None = None,
    loss_scale_factor: float | None = None,
    dp_size: int = 1,
) -> Tensor:
    """Aggregate a per-token loss into the scalar to differentiate.

    With L the loss matrix, m the mask and ℓ_i = Σ_t m_it the response lengths:

        token-mean               Σ_it L m / N_tok                        · dp_size
        token-sum                Σ_it L m                                · dp_size
        seq-mean-token-sum       Σ_i Σ_t L m / N_seq                     · dp_size
        seq-mean-token-mean      Σ_i (Σ_t L m / (ℓ_i + 1e-8)) / N_seq    · dp_size
        seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor  (Dr.GRPO)

    Args:
        loss_mat: `[B, T]` per-token loss.
        mask: `[B, T]` 0/1; masked-out positions never contribute (NaN-safe).
        mode: one of `LOSS_AGG_MODES`.
        num_tokens: N_tok, the number of valid tokens in the whole mini-batch (every micro-batch,
            every rank). None: this call's `mask.sum()` (only right when it sees the whole batch).
        num_seqs: N_seq, the number of sequences in the whole mini-batch (verl passes
            `ppo_mini_batch_size * n`). None: this call's number of non-empty rows.
        loss_scale_factor: the Dr.GRPO constant; None = T of this `loss_mat` (verl's default).
            Pass a constant (e.g. the max response length) when micro-batches differ in width.
        dp_size: number of data-parallel ranks whose gradients the engine *averages*; the loss is
            scaled by it so the averaged gradient is the gradient of the global mean.
    Returns:
        a scalar tensor.
    """
    if mode == "token-mean":
        if num_tokens is None:
            _require_local(dp_size, "num_tokens", mode)
            num_tokens = mask.sum()
        return masked_sum(loss_mat, mask) / num_tokens * dp_size
    if mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        lengths = mask.sum(dim=-1)
        seq_losses = masked_sum(loss_mat, mask, dim=-1)  # [B]
        if mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (lengths + 1e-8)
        non_empty = lengths > 0
        if num_seqs is None:
            _require_local(dp_size, "num_seqs", mode)
            num_seqs = non_empty.sum()
        loss = masked_sum(seq_losses, non_empty) / num_seqs * dp_size
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(sorted(LOSS_AGG_MODES))}")


def _require_local(dp_size: int, normaliser: str, mode: str) -> None:
    if dp_size > 1:
        raise ValueError(
            f"agg_loss mode {mode!r} with dp_size={dp_size} needs the global {normaliser} "
            "(summed over all ranks); a rank-local count would give each rank a different scale"
        )


# ----------------------------------------------------------------------------------------------
# policy losses


@dataclass(frozen=True)
class _RegisteredLoss:
    fn: PolicyLossFn
    params: Mapping[str, Any]  # the loss's own parameters and their defaults
    aggregates: bool  # fn returns the aggregated scalar itself


_POLICY_LOSSES: dict[str, _RegisteredLoss] = {}
# What policy_loss passes every loss (the aggregation inputs only to losses that aggregate on their own).
_CALL_INPUTS = frozenset(
    {"old_log_probs", "log_probs", "advantages", "response_mask", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c"}
    | {"loss_agg_mode", "rollout_is_weights", "num_tokens", "num_seqs", "loss_scale_factor", "dp_size"}
)


def register_policy_loss(
    name: str, *, params: Mapping[str, Any] | None = None, aggregates: bool = False
) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name`.

    The function is called with keywords `old_log_probs, log_probs, advantages, response_mask,
    clip_ratio_low, clip_ratio_high, clip_ratio_c` (all `[B, T]` tensors or floats) and, by name,
    each of its `params`. By default it returns `(loss_mat [B, T], metrics)` and `policy_loss`
    applies the rollout importance weights and aggregates.

    Args:
        name: the `loss_mode` it answers to; registering a taken name raises `ValueError`.
        params: the loss's own parameters with their defaults, e.g. `{"tau_pos": 1.0}`;
            `policy_loss(name, ..., tau_pos=2.0)` overrides one, an undeclared name is refused.
        aggregates: the loss aggregates on its own (a sequence-level objective, a choice of tokens
            over the micro-batch): it is also called with `loss_agg_mode, rollout_is_weights,
            num_tokens, num_seqs, loss_scale_factor, dp_size` and returns `(scalar loss, metrics)`.
            Honour the normalisers (see `agg_loss`) to keep the loss micro-batch-split invariant.
    """

    taken = sorted(set(params or {}) & _CALL_INPUTS)
    if taken:
        raise ValueError(
            f"policy loss {name!r} declares {', '.join(taken)}, which every loss is given already; "
            "read it from the keyword arguments instead"
        )

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered; register under another name")
        _POLICY_LOSSES[name] = _RegisteredLoss(fn=fn, params=dict(params or {}), aggregates=aggregates)
        return fn

    return decorator


def policy_loss_names() -> list[str]:
    """Sorted names accepted by `policy_loss` (and `actor.policy_loss.loss_mode`)."""
    return sorted(_POLICY_LOSSES)


def policy_loss_params(mode: str) -> dict[str, Any]:
    """The parameters the loss `mode` declares, with their defaults (`{}` for most losses)."""
    return dict(_registered(mode).params)


def _registered(mode: str) -> _RegisteredLoss:
    entry = _POLICY_LOSSES.get(mode)
    if entry is None:
        raise ValueError(f"unknown policy loss {mode!r}; valid names: {', '.join(policy_loss_names())}")
    return entry


def policy_loss(
    mode: str,
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Tensor | None = None,
    num_tokens: Tensor | int | None = None,
    num_seqs: Tensor | int | None = None,
    loss_scale_factor: float | None = None,
    dp_size: int = 1,
    **params: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy-gradient loss `mode` for one (micro-)batch.

        loss = agg_loss(ℓ_mode(old_log_probs, log_probs, A) · rollout_is_weights, response_mask)

    (a loss registered with `aggregates=True` computes `loss` itself from the same inputs).

    Args:
        mode: an entry of `policy_loss_names()`.
        old_log_probs, log_probs, advantages, response_mask: `[B, T]`; only `log_probs` needs grad.
        loss_agg_mode, num_tokens, num_seqs, loss_scale_factor, dp_size: see `agg_loss`.
        clip_ratio_low, clip_ratio_high: ratio clipped to [1 - low, 1 + high].
        clip_ratio_c: dual-clip bound for negative advantages (vanilla), > 1.
        rollout_is_weights: `[B, T]` truncated importance weights rollout -> trainer (constants),
            multiplying the per-token loss.
        params: the loss's own parameters under verl's names (`policy_loss_params(mode)` lists
            them with their defaults); any other name raises `ValueError`.
    Returns:
        `(loss, metrics)`: scalar loss; detached scalar tensors named as in verl (`actor/pg_clipfrac`,
        `actor/ppo_kl`, `actor/pg_clipfrac_lower`: each loss's docstring lists its own).
    """
    entry = _registered(mode)
    unknown = sorted(set(params) - set(entry.params))
    if unknown:
        valid = ", ".join(sorted(entry.params)) or "none"
        raise ValueError(f"policy loss {mode!r} takes no parameter {', '.join(unknown)}; its parameters: {valid}")
    inputs = dict(
        old_log_probs=old_log_probs,
        log_probs=log_probs,
        advantages=advantages,
        response_mask=response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_c=clip_ratio_c,
        **{**entry.params, **params},
    )
    normalisers: dict[str, Any] = dict(
        num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor, dp_size=dp_size
    )
    if entry.aggregates:
        loss, metrics = entry.fn(
            **inputs, loss_agg_mode=loss_agg_mode, rollout_is_weights=rollout_is_weights, **normalisers
        )
    else:
        loss_mat, metrics = entry.fn(**inputs)
        if rollout_is_weights is not None:
            loss_mat = loss_mat * rollout_is_weights
        loss = agg_loss(loss_mat, response_mask, loss_agg_mode, **normalisers)
    return loss, {key: value.detach() for key, value in metrics.items()}


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, https://arxiv.org/abs/1707.06347) with dual
    clip for negative advantages (Ye et al. 2019, https://arxiv.org/abs/1912.09729).

        r = exp(clamp(log_probs - old_log_probs, -20, 20))
        ℓ_clip = max(-A r, -A clip(r, 1 - low, 1 + high))
        ℓ = min(ℓ_clip, -A c)  where A < 0,  ℓ_clip elsewhere        (c = clip_ratio_c > 1)

    Metrics: pg_clipfrac = mean[-A clip(r) > -A r], ppo_kl = mean[-log r],
    pg_clipfrac_lower = mean[ℓ_clip > -A c and A < 0], means over the mask. Shapes `[B, T]`.
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO; got {clip_ratio_c}. Set it to e.g. 3.0")
    log_ratio = torch.clamp(log_probs - old_log_probs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    loss_mat = torch.where(negative, torch.minimum(dual_bound, clip_loss), clip_loss)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
        "actor/pg_clipfrac_lower": masked_mean(((clip_loss > dual_bound) & negative).float(), response_mask),
    }
    return loss_mat, metrics


@register_policy_loss("gspo")
def gspo_policy_loss(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    **_: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO, sequence-level importance ratio (Zheng et al. 2025, https://arxiv.org/abs/2507.18071).

        log s_i = Σ_t m (log_probs - old_log_probs) / max(1, ℓ_i)           (length-normalised)
        s_it = exp(min(10, sg[log s_i] + log_probs_it - sg[log_probs_it]))  (value s_i, token grad)
        ℓ = max(-A s, -A clip(s, 1 - low, 1 + high))

    The paper aggregates with seq-mean-token-mean; any `loss_agg_mode` is accepted.
    Metrics: pg_clipfrac, ppo_kl (token-level, unclamped), pg_clipfrac_lower = 0. Shapes `[B, T]`.
    """
    log_ratio = log_probs - old_log_probs
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (log_ratio * response_mask).sum(dim=-1) / lengths
    token_log_ratio = log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=_GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
        "actor/pg_clipfrac_lower": torch.zeros((), device=loss_mat.device),
    }
    return loss_mat, metrics


@register_policy_loss("cispo")
def cispo_policy_loss(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    **_: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO, clipped importance-sampling weight with stop-gradient (MiniMax 2025,
    https://arxiv.org/abs/2506.13585).

        r = exp(clamp(log_probs - old_log_probs, -20, 20))
        ℓ = -sg[clip(r, 1 - low, 1 + high)] · A · log_probs

    Every token keeps a gradient (through log_probs), clipped or not.
    Metrics: pg_clipfrac = mean[clip(r) ≠ r], ppo_kl, pg_clipfrac_lower = 0. Shapes `[B, T]`.
    """
    log_ratio = torch.clamp(log_probs - old_log_probs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = -clipped_ratio.detach() * advantages * log_probs
    metrics = {
        "actor/pg_clipfrac": masked_mean((ratio != clipped_ratio).float(), response_mask),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
        "actor/pg_clipfrac_lower": torch.zeros((), device=loss_mat.device),
    }
    return loss_mat, metrics


@register_policy_loss("gpg")
def gpg_policy_loss(*, log_probs: Tensor, advantages: Tensor, **_: object) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG, plain policy gradient without ratio or clipping (Chu et al. 2025,
    https://arxiv.org/abs/2504.02546).

        ℓ = -A · log_probs

    No metrics. Shapes `[B, T]`.
    """
    return -log_probs * advantages, {}


def _dppo(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_c: float,
    trusted: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO's loss given its trust region: the tokens whose update stays inside it (`trusted`, `[B, T]` bool)."""
    log_ratio = torch.clamp(log_probs - old_log_probs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    trusted = trusted.detach().float()
    loss_mat = -advantages * torch.clamp(ratio, max=clip_ratio_c).detach() * log_probs * trusted
    metrics = {
        "actor/pg_clipfrac": masked_mean(1.0 - trusted, response_mask),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
        "actor/pg_clipfrac_lower": masked_mean((ratio > clip_ratio_c).float() * trusted, response_mask),
    }
    return loss_mat, metrics


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-TV, a trust region on the sampled token's probability (https://arxiv.org/abs/2602.04879).

        r = exp(clamp(log_probs - old_log_probs, -20, 20)),  p = exp(log_probs),  p_old = exp(old_log_probs)
        v = [p - p_old ≤ high]  where A > 0,  [p - p_old ≥ -low]  elsewhere     (no gradient)
        ℓ = -A · sg[min(r, c)] · log_probs · v                                   (c = clip_ratio_c)

    clip_ratio_low/high are thresholds on the probability change (total variation of the binary
    distribution {token, rest}), not ratio clip ranges; c truncates the importance weight instead of
    a dual clip (the paper recommends a large c). verl reads c with a fallback of 20, but its actor
    config always holds clip_ratio_c (3.0 by default), so the fallback never applies: c is
    clip_ratio_c as given. Per-token, so split invariant.
    Metrics: pg_clipfrac = mean[1 - v], pg_clipfrac_lower = mean[r > c and v], ppo_kl = mean[-log r]
    (clamped), over the mask. Shapes `[B, T]`.
    """
    change = torch.exp(log_probs) - torch.exp(old_log_probs)
    trusted = torch.where(advantages > 0, change <= clip_ratio_high, change >= -clip_ratio_low)
    return _dppo(
        old_log_probs=old_log_probs,
        log_probs=log_probs,
        advantages=advantages,
        response_mask=response_mask,
        clip_ratio_c=clip_ratio_c,
        trusted=trusted,
    )


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO-Binary-KL, the trust region as a KL of the binary distribution {token, rest}
    (https://arxiv.org/abs/2602.04879).

        p = exp(log_probs),  p_old = exp(old_log_probs)
        D = p_old (log p_old - log p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        v = [D ≤ high or p ≤ p_old]  where A > 0,  [D ≤ low or p ≥ p_old]  elsewhere   (no gradient)
        ℓ = -A · sg[min(r, c)] · log_probs · v          (r, c as in dppo_tv)

    Only a move in the advantage's direction is limited. Per-token, so split invariant.
    Metrics as dppo_tv. Shapes `[B, T]`.
    """
    prob, old_prob = torch.exp(log_probs), torch.exp(old_log_probs)
    divergence = old_prob * (old_log_probs - log_probs) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    trusted = torch.where(
        advantages > 0,
        (divergence <= clip_ratio_high) | (prob <= old_prob),
        (divergence <= clip_ratio_low) | (prob >= old_prob),
    )
    return _dppo(
        old_log_probs=old_log_probs,
        log_probs=log_probs,
        advantages=advantages,
        response_mask=response_mask,
        clip_ratio_c=clip_ratio_c,
        trusted=trusted,
    )


@register_policy_loss("sapo", params={"tau_pos": 1.0, "tau_neg": 1.05}, aggregates=True)
def sapo_policy_loss(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    tau_pos: float,
    tau_neg: float,
    rollout_is_weights: Tensor | None,
    num_seqs: Tensor | int | None,
    dp_size: int,
    **_: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO, Soft Adaptive Policy Optimization: a smooth gate in place of the clip
    (https://arxiv.org/abs/2511.20347).

        r = exp(clamp(log_probs - old_log_probs, -20, 20))
        τ = tau_pos where A > 0, tau_neg elsewhere
        ℓ = -A · (4/τ) · σ(τ (r - 1))          (gradient -A · 4σ(1 - σ) · r: -A at r = 1, fading away from it)
        loss = agg_loss(ℓ · rollout_is_weights, mask, "seq-mean-token-mean")

    Always seq-mean-token-mean, as the paper and verl: `loss_agg_mode` is not read (the actor still
    aggregates its entropy and KL terms with it). Split invariant with the global `num_seqs`.
    Metrics: ppo_kl = mean[-log r] (clamped); pg_clipfrac = pg_clipfrac_lower = 0 (nothing is
    clipped). Shapes `[B, T]`.
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(
            f"SAPO's temperatures must be > 0; got tau_pos={tau_pos}, tau_neg={tau_neg}. Set e.g. 1.0 and 1.05"
        )
    log_ratio = torch.clamp(log_probs - old_log_probs, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(tau_pos, dtype=advantages.dtype, device=advantages.device),
        torch.as_tensor(tau_neg, dtype=advantages.dtype, device=advantages.device),
    )
    loss_mat = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    loss = agg_loss(loss_mat, response_mask, "seq-mean-token-mean", num_seqs=num_seqs, dp_size=dp_size)
    zero = torch.zeros((), device=loss.device)
    metrics = {
        "actor/pg_clipfrac": zero,
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
        "actor/pg_clipfrac_lower": zero,
    }
    return loss, metrics


@register_policy_loss("clip_cov", params={"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0})
def clip_cov_policy_loss(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_cov_ratio: float,
    clip_cov_lb: float,
    clip_cov_ub: float,
    **_: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning Language Models,
    https://arxiv.org/abs/2505.22617): PPO's clip, and no gradient for a few random tokens whose
    advantage and log-prob move together.

        r = exp(log_probs - old_log_probs)                                  (no clamp)
        ℓ_clip = max(-A r, -A clip(r, 1 - low, 1 + high))                  (no dual clip)
        cov = (A - mean A) · (sg[log_probs] - mean sg[log_probs])           (means over the masked tokens)
        C = max(1, ⌊clip_cov_ratio · N⌋) tokens drawn at random among those with
            clip_cov_lb < cov < clip_cov_ub where ℓ_clip is not clipped    (all of them if fewer)
        ℓ = 0 on C,  ℓ_clip elsewhere

    The draw is `torch.randperm` over the candidates in row-major order from the global CPU
    generator, as verl's, so a run seeded alike draws the same tokens. Not micro-batch-split
    invariant: the means, N and the draw are the micro-batch's (as in verl).
    Metrics: pg_clipfrac = the fraction of tokens in C (not of PPO-clipped ones), ppo_kl = mean[-log r].
    Shapes `[B, T]`.
    """
    if not (0 < clip_cov_ratio <= 1 and clip_cov_lb < clip_cov_ub):
        raise ValueError(
            f"clip_cov needs 0 < clip_cov_ratio <= 1 and clip_cov_lb < clip_cov_ub; got {clip_cov_ratio}, "
            f"{clip_cov_lb}, {clip_cov_ub}. Set e.g. 0.0002, 1.0, 5.0"
        )
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    detached = log_probs.detach()
    cov = (advantages - masked_mean(advantages, response_mask)) * (detached - masked_mean(detached, response_mask))
    eligible = (response_mask > 0) & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    candidates = torch.nonzero(eligible)  # [K, 2]
    kept = torch.ones_like(advantages)
    if len(candidates) > 0:  # verl draws nothing then: the generator's state stays the same
        count = max(int(clip_cov_ratio * response_mask.sum().item()), 1)  # host sync: the draw needs the count
        chosen = candidates[torch.randperm(len(candidates))[:count]]
        kept[chosen[:, 0], chosen[:, 1]] = 0
    loss_mat = torch.maximum(unclipped, clipped) * kept
    metrics = {
        "actor/pg_clipfrac": masked_mean((kept == 0).float(), response_mask),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
    }
    return loss_mat, metrics


@register_policy_loss("kl_cov", params={"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1})
def kl_cov_policy_loss(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    kl_cov_ratio: float,
    ppo_kl_coef: float,
    **_: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025, https://arxiv.org/abs/2505.22617): no clip; a |log r| penalty on
    the tokens whose advantage and log-prob move together most.

        r = exp(log_probs - old_log_probs)                                  (no clamp)
        cov = (A - mean A) · (sg[log_probs] - mean sg[log_probs])           (means over the masked tokens)
        K = the max(1, ⌊kl_cov_ratio · N⌋) masked tokens of largest cov     (none when N = 0)
        ℓ = -A r + ppo_kl_coef · |log r|  on K,  -A r elsewhere

    The top-k runs on the host, as verl's, so equal covariances break ties alike. Not
    micro-batch-split invariant: the means, N and K are the micro-batch's (as in verl).
    Metrics: ppo_kl = mean[|log r|] (verl's: absolute, unlike the other losses). Shapes `[B, T]`.
    """
    if not (0 < kl_cov_ratio <= 1 and ppo_kl_coef >= 0):
        raise ValueError(
            f"kl_cov needs 0 < kl_cov_ratio <= 1 and ppo_kl_coef >= 0; got {kl_cov_ratio}, {ppo_kl_coef}. "
            "Set e.g. 0.0002 and 0.1"
        )
    log_ratio = log_probs - old_log_probs
    loss_mat = -advantages * torch.exp(log_ratio)
    valid = response_mask > 0
    flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if len(flat_valid) > 0:
        adv, logp = advantages[valid].detach().cpu(), log_probs[valid].detach().cpu()
        cov = (adv - adv.mean()) * (logp - logp.mean())
        top = torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio))).indices
        penalised = torch.zeros(loss_mat.numel(), dtype=torch.bool, device=loss_mat.device)
        penalised[flat_valid[top.to(flat_valid.device)]] = True
        loss_mat = torch.where(penalised.view_as(loss_mat), loss_mat + ppo_kl_coef * log_ratio.abs(), loss_mat)
    return loss_mat, {"actor/ppo_kl": masked_mean(log_ratio.abs(), response_mask)}


@register_policy_loss("geo_mean", aggregates=True)
def geo_mean_policy_loss(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    rollout_is_weights: Tensor | None,
    num_seqs: Tensor | int | None,
    dp_size: int,
    **_: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, https://arxiv.org/abs/2507.20673):
    a sequence's ratio is the geometric mean of its token ratios, each clipped in log space.

        δ = log_probs - old_log_probs                                        (no clamp)
        δ' = sgn(A) · min(sgn(A) δ, sgn(A) clip(δ, -low, high))
        L_i = -Ā_i · exp(Σ_t m δ' / (n_i + 1e-8)) · w_i,   Ā_i = Σ_t m A / (n_i + 1e-8),  n_i = Σ_t m
        w_i = exp(Σ_t m log(rollout_is_weights + 1e-10) / (n_i + 1e-8))       (1 without weights)
        loss = Σ_i L_i / N_seq · dp_size

    A sequence-level objective: `loss_agg_mode` is not read (the actor still aggregates its entropy
    and KL terms with it); the advantage is meant to be the sequence's (outcome estimators). Split
    invariant with the global `num_seqs`. verl takes the mean of L_i over the micro-batch's rows
    instead, whatever its normalisers: the same loss when the micro-batch is the whole mini-batch on
    one rank and no row is fully masked (verl counts such a row, whose L_i is 0, in the mean; N_seq
    does not, as in `agg_loss`); with several micro-batches verl's sum of their means is not the
    mini-batch's.
    Metrics: pg_clipfrac = mean[δ ≠ clip(δ) and A > 0], pg_clipfrac_lower = mean[δ ≠ clip(δ) and
    A < 0], ppo_kl = mean[-δ]. Shapes `[B, T]`.
    """
    log_ratio = log_probs - old_log_probs
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = response_mask.sum(dim=-1) + 1e-8
    seq_losses = (
        -masked_sum(advantages, response_mask, dim=-1)
        / lengths
        * torch.exp(masked_sum(clipped_log_ratio, response_mask, dim=-1) / lengths)
    )
    if rollout_is_weights is not None:
        log_weights = torch.log(rollout_is_weights + 1e-10)
        seq_losses = seq_losses * torch.exp(masked_sum(log_weights, response_mask, dim=-1) / lengths)
    # each sequence's loss as a one-token row: agg_loss's seq-mean counts the non-empty rows
    non_empty = (response_mask.sum(dim=-1) > 0).unsqueeze(-1)
    loss = agg_loss(seq_losses.unsqueeze(-1), non_empty, "seq-mean-token-sum", num_seqs=num_seqs, dp_size=dp_size)
    outside = log_ratio != clamped
    metrics = {
        "actor/pg_clipfrac": masked_mean((outside & (advantages > 0)).float(), response_mask),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask),
        "actor/pg_clipfrac_lower": masked_mean((outside & (advantages < 0)).float(), response_mask),
    }
    return loss, metrics


@register_policy_loss("dro", params={"dro_beta": None})
def dro_policy_loss(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    dro_beta: float | None,
    **_: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO, Direct Reward Optimization (Richemond et al. 2024, https://arxiv.org/abs/2405.19107):
    the policy gradient with a quadratic penalty on the log-ratio.

        ℓ = -(A · log_probs - β/2 · (log_probs - old_log_probs)²)        (β = dro_beta > 0)

    β has no default (verl's neither). Per-token, so split invariant.
    Metrics: ppo_kl = mean[-log r]. Shapes `[B, T]`.
    """
    if dro_beta is None or not dro_beta > 0:
        raise ValueError(
            f"dro needs dro_beta > 0, the weight of its log-ratio penalty; got {dro_beta}. Set it, e.g. to 0.1"
        )
    log_ratio = log_probs - old_log_probs
    loss_mat = -(log_probs * advantages - 0.5 * dro_beta * log_ratio.square())
    return loss_mat, {"actor/ppo_kl": masked_mean(-log_ratio, response_mask)}


# verl 0.9.1's defaults of algorithm.rollout_correction, which its bypass mode hands to this loss.
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
_BYPASS_DEFAULTS = {
    "loss_type": "ppo_clip",
    "rollout_is": None,
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
}


@register_policy_loss("bypass_mode", params={"rollout_correction": _BYPASS_DEFAULTS}, aggregates=True)
def bypass_mode_policy_loss(
    *,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float,
    rollout_correction: Mapping[str, Any],
    loss_agg_mode: str,
    rollout_is_weights: Tensor | None,
    **normalisers: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """verl's bypass mode: the rollout engine's log-probs stand in for the old log-probs (no separate
    old-log-prob pass; Liu et al. 2025, https://richardli.xyz/rl-collapse), corrected against the
    current policy on the fly.

        old_log_probs = log π_rollout;  log ρ = sg[log π_θ] - log π_rollout
        w, m' = correct_rollout(sg[log π_θ], log π_rollout, m, rollout_correction)   (IS weights, rejection)
        ppo_clip:   loss = agg(ℓ_vanilla(r = π_θ / π_rollout), m')          (the ratio is the correction: no w)
        reinforce:  loss = agg(-A · w · log π_θ, m')                        (w = 1 when rollout_is is null)

    `m'` (the response mask less the rejected tokens) is the aggregation mask: it sets the
    per-sequence lengths of seq-mean-token-mean and which rows count, while the mini-batch
    normalisers (`num_tokens`, `num_seqs`) stay those of `m`, as in verl. `rollout_is_weights` from
    the caller is ignored (verl recomputes them here).

    Not micro-batch-split invariant, as in verl: the IS weights and rejection use the current
    policy, so they change after each optimizer step of an epoch; `rollout_is_batch_normalize`
    normalises over the micro-batch given. The metrics are micro-batch statistics.

    Args:
        rollout_correction: `loss_type` (`ppo_clip` | `reinforce`), `rollout_is`,
            `rollout_is_threshold`, `rollout_is_batch_normalize`, `rollout_rs`,
            `rollout_rs_threshold` (see `dsrl.algorithms.rollout_correction`); missing keys take
            verl's defaults (no IS weights, no rejection, ppo_clip).
        the rest: see `policy_loss`. Shapes `[B, T]`.
    Returns:
        `(loss, metrics)`: `actor/ppo_kl` (and vanilla's clip fractions for ppo_clip), and the
        `rollout_corr/*` diagnostics of π_θ against π_rollout.
    """
    unknown = sorted(set(rollout_correction) - set(_BYPASS_DEFAULTS))
    if unknown:
        raise ValueError(
            f"bypass_mode's rollout_correction has no key {', '.join(unknown)}; its keys: {', '.join(_BYPASS_DEFAULTS)}"
        )
    settings = {**_BYPASS_DEFAULTS, **rollout_correction}
    loss_type = settings.pop("loss_type")
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"bypass_mode's loss_type {loss_type!r} is unknown; use one of {', '.join(BYPASS_LOSS_TYPES)}")
    rollout_log_probs = old_log_probs
    weights, kept, correction_metrics = correct_rollout(
        log_probs.detach(), rollout_log_probs, response_mask, **settings
    )
    if loss_type == "ppo_clip":
        loss_mat, metrics = vanilla_policy_loss(
            old_log_probs=rollout_log_probs,
            log_probs=log_probs,
            advantages=advantages,
            response_mask=kept,
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=clip_ratio_c,
        )
    else:
        loss_mat = -advantages * log_probs if weights is None else -advantages * log_probs * weights
        metrics = {"actor/ppo_kl": masked_mean(rollout_log_probs - log_probs, kept)}
    loss = agg_loss(loss_mat, kept, loss_agg_mode, **normalisers)
    return loss, {**metrics, **correction_metrics}


# ----------------------------------------------------------------------------------------------
# value loss


def value_loss(
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    num_tokens: Tensor | int | None = None,
    num_seqs: Tensor | int | None = None,
    loss_scale_factor: float | None = None,
    dp_size: int = 1,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss (PPO, https://arxiv.org/abs/1707.06347).

        v_clip = clip(vpreds, values - c, values + c)
        loss = 0.5 · agg_loss(max((vpreds - R)², (v_clip - R)²), mask)

    Args:
        vpreds: `[B, T]` critic predictions being trained.
        values: `[B, T]` critic values from before the update.
        returns: `[B, T]` targets R.
        response_mask: `[B, T]`.
        cliprange_value: c.
        loss_agg_mode, num_tokens, num_seqs, loss_scale_factor, dp_size: see `agg_loss`.
    Returns:
        `(loss, clipfrac)`: scalar loss and the detached fraction of masked tokens where the
        clipped term is larger (log it as `critic/vf_clipfrac`).
    """
    vpred_clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    unclipped = (vpreds - returns).square()
    clipped = (vpred_clipped - returns).square()
    loss = 0.5 * agg_loss(
        torch.maximum(unclipped, clipped),
        response_mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        loss_scale_factor=loss_scale_factor,
        dp_size=dp_size,
    )
    clipfrac = masked_mean((clipped > unclipped).float(), response_mask).detach()
    return loss, clipfrac
