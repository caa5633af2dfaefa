"""Step metrics computed from a batch, reduced over all ranks (verl's metric names).

Every rank calls these (they are collectives) and gets the same numbers.
"""

from __future__ import annotations

import torch

from dsrl.algorithms import RolloutCorrection
from dsrl.data.batch import Batch
from dsrl.distributed import global_mean, global_stats


def _add_stats(metrics: dict[str, float], name: str, values: torch.Tensor) -> None:
    metrics[f"{name}/mean"], metrics[f"{name}/max"], metrics[f"{name}/min"] = global_stats(values)


def batch_metrics(batch: Batch, max_response_length: int) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one step's batch."""
    mask = batch.response_mask.bool()
    response_length = mask.sum(-1).float()  # [B]
    metrics: dict[str, float] = {}
    _add_stats(metrics, "critic/score", batch.token_level_scores.sum(-1))
    _add_stats(metrics, "critic/rewards", batch.token_level_rewards.sum(-1))
    _add_stats(metrics, "critic/advantages", batch.advantages[mask])
    _add_stats(metrics, "critic/returns", batch.returns[mask])
    if batch.values is not None:
        _add_stats(metrics, "critic/values", batch.values[mask])
    _add_stats(metrics, "response_length", response_length)
    metrics["response_length/clip_ratio"] = global_stats((response_length >= max_response_length).float())[0]
    _add_stats(metrics, "prompt_length", batch.prompt_mask.sum(-1).float())
    return metrics


def rollout_logprob_metrics(batch: Batch) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the actor's on the same tokens."""
    diff = (batch.rollout_log_probs - batch.old_log_probs).abs()[batch.response_mask.bool()]
    mean, hi, _ = global_stats(diff)
    return {"rollout/logprob_diff_mean": mean, "rollout/logprob_diff_max": hi}


def rollout_correction_metrics(batch: Batch, correction: RolloutCorrection) -> dict[str, float]:
    """Importance ratios rollout -> actor over the response tokens, whether or not they are applied."""
    mask = batch.response_mask.bool()
    mean, hi, lo = global_stats(correction.ratio[mask])
    return {
        "rollout_corr/is_ratio_mean": mean,
        "rollout_corr/is_ratio_max": hi,
        "rollout_corr/is_ratio_min": lo,
        "rollout_corr/is_weight_mean": global_mean(correction.weights[mask]),
        "rollout_corr/masked_fraction": global_mean(1.0 - correction.keep_mask[mask]),
    }
