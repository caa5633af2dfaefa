"""The variance of the actor's gradient across micro-batches, measured
(``actor_rollout_ref.actor.measure_grad_variance``).

A mini-batch's loss is a sum of micro-batch losses ``l_k`` (``training.py``: each normalised by the mini-batch's
global token or sequence count), so its gradient is ``G = sum_k g_k`` with ``g_k = grad l_k``, over every
micro-batch ``k`` of every rank. Micro-batch ``k`` holds the share ``w_k`` of the mini-batch's normaliser (of its
response tokens for the ``token-*`` loss aggregations, of its sequences for the ``seq-*`` ones), so
``h_k = g_k / w_k`` is the gradient that micro-batch alone gives (its own token or sequence mean): an estimate of
``G`` from a ``w_k`` part of the data. The metric is the weighted sample variance of those estimates, the trace of
their covariance::

    actor/grad_var = sum_k w_k ||h_k - G||^2 / (1 - sum_k w_k^2)
                   = (sum_k ||g_k||^2 / w_k - ||G||^2) / (1 - sum_k w_k^2)

(``K`` equal shares: ``K/(K-1) * mean_k ||h_k - G||^2``, the unbiased variance of the ``K`` estimates).
``||g_k||^2`` is measured, not estimated: hooks on the trainable parameters add up each parameter's squared
gradient norm as a backward pass produces it, before DeepSpeed accumulates, reduces or partitions it; ``||G||`` is
DeepSpeed's global gradient norm before clipping. ``actor/grad_var_relative = grad_var / ||G||^2`` is the
scale-free form: estimators whose advantages differ in scale (GRPO's divided by the group's std, RLOO's, OPO's
and OTB's not) compare on it. The loss is the actor's whole loss: the policy loss plus its entropy and KL terms
where the config has them. Defined with two or more micro-batches per optimizer step over all ranks (else not
logged); like the other actor metrics, averaged over a step's optimizer steps. It grows as micro-batches shrink
(roughly as 1 / their size), so runs compare at the same micro-batch size.

verl's ``variance_proxy/*`` (``dsrl.trainer.metrics.variance_proxy_metrics``, logged where ``sum_pi_squared`` is
computed) is another thing: per response, ``A^2`` times ``W = sum_t (1 - 2 pi_t + sum_v pi_v^2)``, the squared norm of
the gradient of the token log-probs with respect to the logits, so an estimate from the logits standing in for the
parameters' gradient, and its "pure noise" that power less the squared gradient norm over ``N - 1``.
"""

from __future__ import annotations

import math

import torch

# the run_ppo_updates sums (all-reduced with the loss metrics) the variance is computed from
SUM_SQUARED_OVER_SHARE = "grad_var/sum_squared_over_share"
SUM_SHARE_SQUARED = "grad_var/sum_share_squared"


class MicroBatchGradNorms:
    """The squared norm of the gradient one backward pass gives ``module``'s trainable parameters.

    A hook on each parameter adds its gradient's squared norm (in float32, whatever the training dtype) as
    autograd produces it: the gradient of this pass alone, before it is accumulated into ``.grad`` and before
    ZeRO reduces or partitions it; a parameter used twice (tied embeddings) gets its summed gradient once."""

    def __init__(self, module: torch.nn.Module):
        self._total: torch.Tensor | None = None
        self._handles = [p.register_hook(self._add) for p in module.parameters() if p.requires_grad]

    def _add(self, grad: torch.Tensor) -> None:
        squared = torch.linalg.vector_norm(grad, dtype=torch.float32).double() ** 2
        self._total = squared if self._total is None else self._total + squared

    def take(self, device: torch.device | str) -> torch.Tensor:
        """The squared norm since the last call (0 when no gradient came), a float64 scalar on ``device``."""
        total = torch.zeros((), dtype=torch.float64) if self._total is None else self._total
        self._total = None
        return total.to(device)


def micro_batch_share(response_mask: torch.Tensor, *, loss_agg_mode: str, num_tokens: float, num_seqs: float) -> float:
    """A micro-batch's share ``w_k`` of its mini-batch's loss normaliser: of the tokens (``token-*`` modes) or of the
    sequences with a response token (``seq-*``); ``num_tokens``/``num_seqs`` are the mini-batch's global counts."""
    mask = response_mask.float()
    if loss_agg_mode.startswith("token-"):
        return float(mask.sum()) / num_tokens
    return float((mask.sum(-1) > 0).sum()) / num_seqs


def grad_variance(sum_squared_over_share: float, sum_share_squared: float, grad_norm: float) -> tuple[float, float]:
    """(``grad_var``, ``grad_var_relative``) of one optimizer step from ``sum_k ||g_k||^2 / w_k``,
    ``sum_k w_k^2`` and ``||G||`` (the module docstring's formula); nan with a single micro-batch (no spread)."""
    spread = 1.0 - sum_share_squared
    if spread <= 1e-12 or not math.isfinite(grad_norm):
        return math.nan, math.nan
    variance = max(sum_squared_over_share - grad_norm**2, 0.0) / spread  # >= 0 up to rounding
    return variance, variance / grad_norm**2 if grad_norm > 0 else math.nan
