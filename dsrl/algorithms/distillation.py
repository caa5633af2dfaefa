"""On-policy distillation's loss: the student learns from a teacher's log-probs of the student's own samples.

Semantics, metric names included, follow verl 0.9.1's `distillation_loss` with its single-sample estimators
(`loss_mode` k1 | kl | k2 | mse | k3 | low_var_kl | abs) and `distillation_ppo_loss`'s combination with the
task's policy loss. Two ways to learn from the per-token divergence d = kl_penalty(log π_s, log π_t):

- supervised (GKD, Agarwal et al. 2023, https://arxiv.org/abs/2306.13649): d is the loss, backpropagated;
  use k3, whose gradient depends on the teacher (k1's does not).
- policy gradient (Thinking Machines 2025, https://thinkingmachines.ai/blog/on-policy-distillation/):
  -d is each token's advantage (a dense reward) in the vanilla clipped loss; use k1.
"""

from __future__ import annotations

import torch

from dsrl.algorithms.kl import kl_penalty
from dsrl.algorithms.losses import agg_loss, policy_loss
from dsrl.algorithms.tensor_ops import masked_mean

Tensor = torch.Tensor

# verl's distillation config has no clip_ratio_c, so its vanilla loss takes the dual-clip default.
_PG_CLIP_RATIO_C = 3.0


def distillation_loss(
    log_probs: Tensor,
    teacher_log_probs: Tensor,
    response_mask: Tensor,
    *,
    loss_mode: str,
    loss_max_clamp: float | None,
    use_policy_gradient: bool,
    old_log_probs: Tensor | None,
    clip_ratio_low: float,
    clip_ratio_high: float,
    loss_agg_mode: str,
    num_tokens: Tensor | int,
    num_seqs: Tensor | int,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The distillation loss of one (micro-)batch of the student's sampled tokens.

        d = kl_penalty(log_probs, teacher_log_probs, loss_mode)      (grad through log_probs)
        d' = clamp(d, -c, c)                                          (c = loss_max_clamp; none when None)
        supervised:       loss = agg_loss(d', m)
        policy gradient:  loss = policy_loss("vanilla", A = -sg[d'], old_log_probs, clip_ratio_c = 3)

    Args:
        log_probs: `[B, T]` the student's log-probs of its sampled tokens, with grad.
        teacher_log_probs: `[B, T]` the teacher's log-probs of the same tokens.
        response_mask: `[B, T]` 0/1.
        loss_mode: a KL kind of `kl_penalty` (verl's distillation accepts k1, kl, k2, mse, k3, low_var_kl, abs).
        loss_max_clamp: c > 0, or None for no clamp.
        use_policy_gradient: the policy-gradient form instead of the supervised one.
        old_log_probs: `[B, T]` the behaviour policy's log-probs, the ratio's denominator; needed with
            `use_policy_gradient`.
        clip_ratio_low, clip_ratio_high: the ratio's clip range (policy gradient).
        loss_agg_mode, num_tokens, num_seqs: see `agg_loss`.
        rollout_is_weights: `[B, T]` rollout importance weights, multiplying the per-token policy-gradient loss
            (the supervised loss takes none, as verl's).
    Returns:
        `(loss, metrics)`: the scalar loss and detached metrics over this batch's response tokens, of d
        before the clamp: `distillation/abs_loss` (mean |d|), `distillation/loss_min`, `distillation/loss_max`
        (+inf / -inf without a response token), `distillation/loss` (the loss); with the policy gradient
        also vanilla's `distillation/pg_clipfrac`, `distillation/ppo_kl`, `distillation/pg_clipfrac_lower`.
    """
    divergence = kl_penalty(log_probs, teacher_log_probs, loss_mode)
    valid = response_mask.bool()
    detached = divergence.detach()
    metrics = {
        "distillation/abs_loss": masked_mean(detached.abs(), response_mask),
        "distillation/loss_min": torch.where(valid, detached, torch.inf).amin(),
        "distillation/loss_max": torch.where(valid, detached, -torch.inf).amax(),
    }
    if loss_max_clamp is not None:
        # both ends: k1 is negative where the student is less likely than the teacher
        divergence = divergence.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    if use_policy_gradient:
        if old_log_probs is None:
            raise ValueError(
                "the policy-gradient distillation loss needs old_log_probs for its ratio; pass them, "
                "or use_policy_gradient=False"
            )
        loss, pg_metrics = policy_loss(
            "vanilla",
            old_log_probs=old_log_probs,
            log_probs=log_probs,
            advantages=-divergence.detach(),
            response_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            clip_ratio_low=clip_ratio_low,
            clip_ratio_high=clip_ratio_high,
            clip_ratio_c=_PG_CLIP_RATIO_C,
            rollout_is_weights=rollout_is_weights,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        metrics |= {"distillation/" + name.removeprefix("actor/"): value for name, value in pg_metrics.items()}
    else:
        loss = agg_loss(divergence, response_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics["distillation/loss"] = loss.detach()
    return loss, metrics


def combined_loss(task_loss: Tensor, distill_loss: Tensor, *, use_task_rewards: bool, coef: float) -> Tensor:
    """The actor's loss with distillation, as verl's `distillation_ppo_loss` combines them.

        use_task_rewards:  task_loss + coef · distill_loss
        otherwise:         distill_loss        (the task's loss, its entropy and KL terms too, is dropped; no coef)

    Args:
        task_loss: the scalar task loss (policy loss with its entropy and KL terms).
        distill_loss: the scalar from `distillation_loss`.
        use_task_rewards: keep the task's loss beside the distillation loss.
        coef: the distillation loss's weight beside the task's.
    """
    return task_loss + coef * distill_loss if use_task_rewards else distill_loss
