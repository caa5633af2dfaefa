"""PF-PPO: the step's batch resampled by reward, with the weights of verl 0.9.1.

Policy filtration for PPO ("Policy Filtration in RLHF to Fine-Tune LLM for Code Generation",
https://arxiv.org/abs/2409.06957) trains more on the responses whose reward is most reliable. As verl computes it, every
row's outcome score s_i = Σ_t token_level_scores[i, t] gives a weight, and B rows are drawn with replacement with
probabilities proportional to the weights:

    pow:         w_i = |s_i| ^ weight_pow
    max_min:     w_i = 1 if s_i is the batch's highest or lowest score, else 0
    max_random:  w_i = 0.4 if s_i is the batch's highest score, else 0.1
    then         w_i <- max(w_i + 1e-8, 1e-8)      (every row keeps a chance)

The draw takes an explicit generator, so a caller that seeds it from the step reproduces it exactly.
"""

from __future__ import annotations

import torch

PF_PPO_METHODS = ("pow", "max_min", "max_random")
_WEIGHT_FLOOR = 1e-8


def pf_ppo_weights(scores: torch.Tensor, reweight_method: str, weight_pow: float) -> torch.Tensor:
    """Sampling weights `[B]` of the rows with outcome scores `scores` `[B]` (formulas above)."""
    if reweight_method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif reweight_method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif reweight_method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(f"unknown PF-PPO reweight_method {reweight_method!r}; valid: {', '.join(PF_PPO_METHODS)}")
    return (weights + _WEIGHT_FLOOR).clamp(min=_WEIGHT_FLOOR)


def pf_ppo_indices(
    scores: torch.Tensor, reweight_method: str, weight_pow: float, generator: torch.Generator
) -> torch.Tensor:
    """`[B]` int64 row numbers drawn with replacement, with probabilities ∝ `pf_ppo_weights(scores, ...)`.

    `scores` `[B]` must be on the generator's device.
    """
    weights = pf_ppo_weights(scores, reweight_method, weight_pow)
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)
