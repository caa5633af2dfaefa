"""Pure-torch RL math: advantage estimators, policy / value losses, KL, distillation, PF-PPO weights, masked
reductions.

No config objects, I/O or distributed calls: tensors in, tensors out. Estimators and
policy losses are registries by name; `register_estimator` / `register_policy_loss` add your own.
"""

from dsrl.algorithms.distillation import combined_loss, distillation_loss
from dsrl.algorithms.estimators import (
    ESTIMATOR_NEEDS,
    EstimatorInputs,
    compute_advantages,
    estimator_names,
    estimator_needs,
    estimator_options,
    reads_policy,
    register_estimator,
)
from dsrl.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
)
from dsrl.algorithms.losses import (
    BYPASS_LOSS_TYPES,
    LOSS_AGG_MODES,
    agg_loss,
    policy_loss,
    policy_loss_names,
    policy_loss_params,
    register_policy_loss,
    value_loss,
)
from dsrl.algorithms.pf_ppo import PF_PPO_METHODS, pf_ppo_indices, pf_ppo_weights
from dsrl.algorithms.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_RS_OPTIONS,
    RolloutCorrection,
    correct_rollout,
    rollout_correction,
)
from dsrl.algorithms.tensor_ops import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_whiten,
    sum_pi_squared_from_logits,
    truncated_responses,
)

__all__ = [
    "BYPASS_LOSS_TYPES",
    "ESTIMATOR_NEEDS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "PF_PPO_METHODS",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_RS_OPTIONS",
    "AdaptiveKLController",
    "EstimatorInputs",
    "FixedKLController",
    "RolloutCorrection",
    "agg_loss",
    "apply_kl_penalty",
    "combined_loss",
    "compute_advantages",
    "correct_rollout",
    "distillation_loss",
    "entropy_from_logits",
    "estimator_names",
    "estimator_needs",
    "estimator_options",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "pf_ppo_indices",
    "pf_ppo_weights",
    "policy_loss",
    "policy_loss_names",
    "policy_loss_params",
    "reads_policy",
    "register_estimator",
    "register_policy_loss",
    "rollout_correction",
    "sum_pi_squared_from_logits",
    "truncated_responses",
    "value_loss",
]
