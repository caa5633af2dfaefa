"""Rollout correction: importance weights and rejection between the rollout engine and the trainer.

The rollout engine (vLLM in bf16, other kernels, sometimes a stale copy of the weights) samples
from ``π_rollout``; the trainer's loss assumes ``π_train`` (the actor's old log-probs, or in bypass
mode its current detached log-probs). On response tokens, with

    log ρ_t = log π_train(y_t) - log π_rollout(y_t),

verl 0.9.1's two corrections are computed here, under its option names and metric names
(Yao et al. 2025, https://fengyao.notion.site/off-policy-rl; Liu et al. 2025, "When speed kills
stability", https://richardli.xyz/rl-collapse):

- importance weights (``rollout_is``): ``token`` ρ_t, or ``sequence`` ρ_seq = exp(Σ_t log ρ_t) on
  every token; ``rollout_is_threshold`` a number U truncates them at U (TIS), a string
  ``"L_U"`` zeroes those outside [L, U] (IcePop); ``rollout_is_batch_normalize`` rescales them to
  mean 1 over the tensors given (tokens, or sequences for ``sequence``).
- rejection (``rollout_rs``): a comma-separated list of ``ROLLOUT_RS_OPTIONS``; a token (``token_*``)
  or a whole response (``seq_*``) is rejected when any listed divergence leaves its bound. With
  k1 = -log ρ, k2 = ½ (log ρ)², k3 = ρ - 1 - log ρ per token, ``seq_sum``/``seq_mean``/``seq_max``
  reduce them over the response. ``rollout_rs_threshold`` gives one bound for all options or one per
  option (comma-separated): k2/k3 take an upper bound; k1 takes ``"L_U"`` and keeps
  log L <= k1 <= log U (a single U means L = 1/U).

  As in verl, the k1 bounds apply to -log ρ: ``"L_U"`` keeps ratios in [1/U, 1/L] (the same
  interval when L = 1/U, the usual choice; mirrored otherwise).

Log-ratios are clamped to ±20 before ``exp`` so that a wildly wrong token gives a large finite
ratio rather than inf. Everything is ``@torch.no_grad``: weights are constants of the loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from dsrl.algorithms.tensor_ops import masked_mean, masked_sum

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
_LOG_RATIO_BOUND = 20.0  # exp(20) ≈ 5e8: finite, and far beyond any useful threshold


# ----------------------------------------------------------------------------------------------
# option strings


def _positive(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number") from None
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{what}: {text!r} must be a positive finite number")
    return value


def _interval(spec: str, what: str) -> tuple[float, float]:
    lower_text, _, upper_text = spec.partition("_")
    lower, upper = _positive(lower_text, what), _positive(upper_text, what)
    if lower > upper:
        raise ValueError(f"{what}: {spec!r} has its lower bound above its upper bound")
    return lower, upper


def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """``rollout_is_threshold`` as ``(upper, lower)``: a number or numeric string U is ``(U, None)``
    (TIS), ``"L_U"`` is ``(U, L)`` (IcePop). Raises ``ValueError`` naming the rule broken."""
    what = "rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{what}: {spec!r} must be a number (TIS) or a 'lower_upper' string (IcePop)")
    if isinstance(spec, str) and "_" in spec:
        lower, upper = _interval(spec.strip(), what)
        return upper, lower
    return _positive(str(spec), what), None


def parse_rs(rollout_rs: str, threshold: float | str | None) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs`` and ``rollout_rs_threshold`` as ``{option: (lower, upper)}`` in the listed order
    (duplicates dropped); ``lower`` is set for k1 options only. Raises ``ValueError`` naming the rule broken."""
    options = list(dict.fromkeys(part.strip() for part in str(rollout_rs).split(",") if part.strip()))
    unknown = [option for option in options if option not in ROLLOUT_RS_OPTIONS]
    if not options or unknown:
        raise ValueError(
            f"rollout_rs: {rollout_rs!r} must list options (comma-separated) among {', '.join(ROLLOUT_RS_OPTIONS)}"
        )
    if threshold is None or isinstance(threshold, bool):
        raise ValueError("rollout_rs_threshold: rejection needs a threshold (one for all options, or one per option)")
    specs = [part.strip() for part in str(threshold).split(",") if part.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold: {threshold!r} gives {len(specs)} thresholds for {len(options)} rollout_rs "
            "options; give one for all, or one per option"
        )
    specs = specs * len(options) if len(specs) == 1 else specs
    bounds: dict[str, tuple[float | None, float]] = {}
    for option, spec in zip(options, specs, strict=True):
        what = f"rollout_rs_threshold for {option}"
        if option.endswith("k1"):
            bounds[option] = _interval(spec if "_" in spec else f"{1.0 / _positive(spec, what)!r}_{spec}", what)
        elif "_" in spec:
            raise ValueError(f"{what}: {spec!r} must be a single upper bound (only k1 options take 'lower_upper')")
        else:
            bounds[option] = (None, _positive(spec, what))
    return bounds


# ----------------------------------------------------------------------------------------------
# weights, rejection, diagnostics


@torch.no_grad()
def importance_weights(
    log_ratio: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated (TIS) or band-limited (IcePop) importance weights, optionally normalised to mean 1.

        ρ = exp(clamp(log ρ_t, ±20))  (token)   |   exp(clamp(Σ_t m log ρ_t, ±20)) on every token  (sequence)
        w = min(ρ, U) m                         (TIS, threshold U)
          = ρ m [L <= ρ <= U]                   (IcePop, threshold "L_U")
        w /= mean(w)   over tokens (token) or sequences (sequence), when batch-normalised and mean > 1e-8

    The normalising mean is over the tensors given: a trainer splitting a batch into micro-batches
    (or ranks) normalises each separately, so ``rollout_is_batch_normalize`` is not micro-batch-split
    invariant (verl averages over the ranks' current micro-batches; a single rank matches it).

    Args:
        log_ratio: ``[B, T]`` log π_train - log π_rollout (padding may hold anything).
        response_mask: ``[B, T]`` 0/1.
        rollout_is, rollout_is_threshold, rollout_is_batch_normalize: see the module docstring.
    Returns:
        ``(weights [B, T] 0 on padding, metrics)``: verl's ``rollout_is_*`` statistics (unprefixed).
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is: {rollout_is!r} must be null or one of {', '.join(ROLLOUT_IS_LEVELS)}")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    mask = response_mask.to(log_ratio.dtype)
    if rollout_is == "token":
        stat_log_ratio = log_ratio  # the ratio's log, at the weight's level
        raw = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()
    else:
        stat_log_ratio = masked_sum(log_ratio, mask, dim=-1)[:, None]
        raw = stat_log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp().expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, stat_log_ratio, mask, rollout_is, upper, lower)
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, mask)
        else:
            has_tokens = (mask.sum(-1) > 0).to(weights.dtype)
            mean = (masked_mean(weights, mask, dim=-1) * has_tokens).sum() / has_tokens.sum().clamp_min(1e-8)
        usable = mean > 1e-8
        weights = torch.where(usable, weights / mean, weights)
        metrics["rollout_is_batch_norm_factor"] = torch.where(usable, mean, torch.ones_like(mean))
    return weights, metrics


def _is_metrics(
    weights: Tensor, raw: Tensor, stat_log_ratio: Tensor, mask: Tensor, level: str, upper: float, lower: float | None
) -> dict[str, Tensor]:
    """verl's IS statistics: mean/max/min of the weights, the fractions of raw ratios outside the
    bounds (lower = 1/upper for TIS), std and effective sample size of the weights, per-sequence means."""
    bool_mask = mask.bool()
    low = 1.0 / upper if lower is None else lower
    if level == "sequence":  # max/min and fractions over the sequence ratios, in log space
        metrics = {
            "rollout_is_max": stat_log_ratio.max().clamp(max=_LOG_RATIO_BOUND).exp(),
            "rollout_is_min": stat_log_ratio.min().exp(),
            "rollout_is_mean": masked_mean(weights, mask),
            "rollout_is_ratio_fraction_high": (stat_log_ratio > math.log(upper)).float().mean(),
            "rollout_is_ratio_fraction_low": (stat_log_ratio < math.log(low)).float().mean(),
        }
    else:
        metrics = {
            "rollout_is_mean": masked_mean(weights, mask),
            "rollout_is_ratio_fraction_high": masked_mean((raw > upper).float(), mask),
            "rollout_is_ratio_fraction_low": masked_mean((raw < low).float(), mask),
            "rollout_is_max": weights.masked_fill(~bool_mask, -math.inf).max(),
            "rollout_is_min": weights.masked_fill(~bool_mask, math.inf).min(),
        }
    bounded = weights.clamp(min=0.0, max=upper)
    bounded_mean = masked_mean(bounded, mask)
    variance = masked_mean(bounded.square(), mask) - bounded_mean.square()
    metrics["rollout_is_std"] = variance.clamp(min=0).sqrt() if mask.sum() > 1 else torch.zeros_like(variance)
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean((bounded / (bounded_mean + 1e-8)).square(), mask)
    seq_means = masked_mean(weights, mask, dim=-1)
    raw_seq_means = masked_mean(raw, mask, dim=-1)
    metrics.update({
        "rollout_is_seq_mean": seq_means.mean(),
        "rollout_is_seq_std": seq_means.std() if seq_means.numel() > 1 else torch.zeros(()),
        "rollout_is_seq_max": seq_means.max(),
        "rollout_is_seq_min": seq_means.min(),
        "rollout_is_seq_max_deviation": (seq_means - 1.0).abs().max(),
        "rollout_is_seq_fraction_high": (raw_seq_means > upper).float().mean(),
        "rollout_is_seq_fraction_low": (raw_seq_means < low).float().mean(),
    })  # fmt: skip
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask)
    return metrics


@torch.no_grad()
def rejection_mask(
    log_ratio: Tensor, response_mask: Tensor, *, rollout_rs: str, rollout_rs_threshold: float | str | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """``response_mask`` with the rejected tokens (or whole responses) set to 0.

        k1 = -log ρ_t,  k2 = ½ (log ρ_t)²,  k3 = ρ_t - 1 - log ρ_t       (log ρ clamped to ±20)
        token_kX: keep token t when its kX passes;  seq_{sum,mean,max}_kX: keep the response when
        Σ_t / mean_t / max_t of kX over its tokens passes.
        pass: log L <= k1 <= log U (k1),  kX <= U (k2, k3);  every listed option must pass.

    Args:
        log_ratio: ``[B, T]`` log π_train - log π_rollout.
        response_mask: ``[B, T]`` 0/1.
        rollout_rs, rollout_rs_threshold: see ``parse_rs``.
    Returns:
        ``(kept mask [B, T] in response_mask's dtype, metrics)``: per option verl's
        ``rollout_rs_<option>_{mean,max,min,fraction_high,fraction_low,masked_fraction,seq_masked_fraction}``,
        and over all options ``rollout_rs_masked_fraction``, ``rollout_rs_seq_masked_fraction``.
    """
    bounds = parse_rs(rollout_rs, rollout_rs_threshold)
    mask = response_mask.to(log_ratio.dtype)
    bool_mask = mask.bool()
    safe = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    divergences = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": safe.exp() - 1.0 - safe}
    reductions = {
        "sum": lambda x: masked_sum(x, mask, dim=-1),
        "mean": lambda x: masked_mean(x, mask, dim=-1),
        "max": lambda x: _max_or_zero(x.masked_fill(~bool_mask, -math.inf).max(dim=-1).values),
    }
    has_tokens = bool_mask.any(dim=-1)
    keep_all = torch.ones_like(mask)
    metrics: dict[str, Tensor] = {}
    for option, (lower, upper) in bounds.items():
        level, _, kind = option.rpartition("_")
        token_stat = divergences[kind]
        if level == "token":
            stat = token_stat
        else:
            stat = reductions[level.removeprefix("seq_")](token_stat)[:, None].expand_as(mask)
        hi = math.log(upper) if kind == "k1" else upper
        lo = math.log(lower) if lower is not None else None  # parse_rs gives k1 options, and only them, a lower bound
        keep = (stat <= hi) & (stat >= lo) if lo is not None else stat <= hi
        keep_all = keep_all * keep.to(mask.dtype)
        prefix = f"rollout_rs_{option}"
        if level == "token":
            high, low = (
                masked_mean((stat > hi).float(), mask),
                masked_mean((stat < lo).float(), mask) if lo is not None else None,
            )
            stat_max = stat.masked_fill(~bool_mask, -math.inf).max()
            stat_min = stat.masked_fill(~bool_mask, math.inf).min()
        else:
            seq_stat = stat[:, 0][has_tokens]
            high = (seq_stat > hi).float().mean()
            low = (seq_stat < lo).float().mean() if lo is not None else None
            stat_max, stat_min = seq_stat.max(), seq_stat.min()
        rejected_seq = ((~keep) & bool_mask).any(dim=-1)
        metrics.update({
            f"{prefix}_mean": masked_mean(stat, mask),
            f"{prefix}_max": stat_max,
            f"{prefix}_min": stat_min,
            f"{prefix}_fraction_high": high,
            f"{prefix}_fraction_low": torch.zeros_like(high) if low is None else low,
            f"{prefix}_masked_fraction": masked_mean(1.0 - keep.to(mask.dtype), mask),
            f"{prefix}_seq_masked_fraction": rejected_seq[has_tokens].float().mean(),
        })  # fmt: skip
    metrics["rollout_rs_masked_fraction"] = masked_mean(1.0 - keep_all, mask)
    metrics["rollout_rs_seq_masked_fraction"] = ((keep_all < 0.5) & bool_mask).any(dim=-1).float().mean()
    return (response_mask * keep_all).to(response_mask.dtype), metrics


def _max_or_zero(values: Tensor) -> Tensor:
    return torch.where(values == -math.inf, torch.zeros_like(values), values)  # a row without tokens: 0


@torch.no_grad()
def off_policy_metrics(train_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """verl's mismatch diagnostics between π_train and π_rollout (unprefixed):

        kl = mean_t(log π_rollout - log π_train),   k3_kl = mean_t(ρ - 1 - log ρ)
        <policy>_ppl = mean_i exp(-mean_t log π),   <policy>_log_ppl = mean_i(-mean_t log π)
        log_ppl_diff_i = mean_t log π_rollout - mean_t log π_train  (mean, |·| mean, max, min; ppl_ratio = mean exp)
        chi2_token = mean_t ρ_t² - 1,   chi2_seq = mean_i exp(2 clamp(Σ_t log ρ_t, ±20)) - 1

    Means over t are over response tokens, over i over all rows. Shapes ``[B, T]``.
    """
    mask = response_mask.to(train_log_probs.dtype)
    log_ratio = train_log_probs - rollout_log_probs
    train_mean = masked_mean(train_log_probs, mask, dim=-1)
    rollout_mean = masked_mean(rollout_log_probs, mask, dim=-1)
    log_ppl_diff = rollout_mean - train_mean
    safe = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    return {
        "training_ppl": (-train_mean).exp().mean(),
        "training_log_ppl": (-train_mean).mean(),
        "kl": masked_mean(-log_ratio, mask),
        "k3_kl": masked_mean(log_ratio.exp() - log_ratio - 1, mask),
        "rollout_ppl": (-rollout_mean).exp().mean(),
        "rollout_log_ppl": (-rollout_mean).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": log_ppl_diff.exp().mean(),
        "chi2_token": masked_mean(safe.exp().square(), mask) - 1.0,
        "chi2_seq": (2.0 * seq_log_ratio).exp().mean() - 1.0,
    }


@torch.no_grad()
def correct_rollout(
    train_log_probs: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
    """Importance weights (``rollout_is`` set), the rejection-masked response mask (``rollout_rs``
    set; else ``response_mask``) and every diagnostic, prefixed ``rollout_corr/`` as in verl.

    Args:
        train_log_probs: ``[B, T]`` π_train's log-probs of the sampled tokens.
        rollout_log_probs: ``[B, T]`` the rollout engine's log-probs of the same tokens.
        response_mask: ``[B, T]`` 0/1.
        the rest: see the module docstring.
    Returns:
        ``(weights [B, T] or None, kept response mask [B, T], metrics)``.
    """
    log_ratio = torch.where(response_mask.bool(), train_log_probs - rollout_log_probs, 0.0)
    weights: Tensor | None = None
    metrics: dict[str, Tensor] = {}
    if rollout_is is not None:
        weights, metrics = importance_weights(
            log_ratio,
            response_mask,
            rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold,
            rollout_is_batch_normalize=rollout_is_batch_normalize,
        )
    kept = response_mask
    if rollout_rs is not None:
        kept, rs_metrics = rejection_mask(
            log_ratio, response_mask, rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold
        )
        metrics.update(rs_metrics)
    metrics.update(off_policy_metrics(train_log_probs, rollout_log_probs, response_mask))
    return weights, kept, {f"rollout_corr/{name}": value for name, value in metrics.items()}


# ----------------------------------------------------------------------------------------------
# the decoupled path (algorithm.rollout_correction): weights on the old-log-prob pass


@dataclass
class RolloutCorrection:
    """The result of ``rollout_correction``; every tensor ``[B, T]`` float32, detached."""

    weights: Tensor  # multiply the per-token loss: the IS weight (or 1) times keep_mask; 0 on padding
    keep_mask: Tensor  # 1 on response tokens that stay in the loss, 0 on rejected ones and on padding
    ratio: Tensor  # the untruncated ratio at the IS level (token level when rollout_is is None); 0 on padding


@torch.no_grad()
def rollout_correction(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
) -> RolloutCorrection:
    """``correct_rollout`` with π_train = the actor's old log-probs, as one weight per token.

        weights = w_IS · keep        (keep alone when rollout_is is None)

    Rejected tokens get weight 0 but stay in the loss normaliser (verl drops them from the response
    mask instead, which also shrinks the denominator of a token-mean).
    """
    mask = response_mask.float()
    weights, kept, _ = correct_rollout(
        old_log_probs.float(),
        rollout_log_probs.float(),
        mask,
        rollout_is=rollout_is,
        rollout_is_threshold=rollout_is_threshold,
        rollout_is_batch_normalize=rollout_is_batch_normalize,
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rollout_rs_threshold,
    )
    log_ratio = torch.where(mask.bool(), old_log_probs.float() - rollout_log_probs.float(), 0.0)
    if rollout_is == "sequence":
        log_ratio = masked_sum(log_ratio, mask, dim=-1)[:, None].expand_as(log_ratio)
    ratio = log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp() * mask
    return RolloutCorrection(weights=kept if weights is None else weights * kept, keep_mask=kept, ratio=ratio)
