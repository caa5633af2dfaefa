"""The names a config key may take: every tuple of accepted values that validation checks a key against.

The first group restates registries of ``dsrl.algorithms``, which the config may not import (it must not import
torch): a built-in estimator, policy loss, KL kind or rollout-correction option added there is added here too, and
``tests/config/test_config_names.py`` fails until both agree. The second group is dsrl's own.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------------------------
# the registries of dsrl.algorithms, restated

# Each built-in estimator and what it needs of a step (dsrl.algorithms.register_estimator's `needs`): "critic" (a
# critic trained beside the actor), "groups" (its baseline comes from the other responses to the same prompt),
# "sum_pi_squared" (sum_v pi(v | s_t)^2 from the actor's forward), "greedy_baseline" (a greedy response per prompt,
# scored: ReMax). The rules, the memory plan and the trainer read these; a user's estimator declares its own
# (config.user_code.estimator_needs reads them from the registry).
ESTIMATOR_NEEDS: dict[str, tuple[str, ...]] = {
    "gae": ("critic",),
    "grpo": ("groups",),
    "grpo_vectorized": ("groups",),
    "rloo": ("groups",),
    "rloo_vectorized": ("groups",),
    "reinforce_plus_plus": (),
    "reinforce_plus_plus_baseline": ("groups",),
    "remax": ("greedy_baseline",),
    "opo": ("groups",),
    "optimal_token_baseline": ("groups", "sum_pi_squared"),
    "tir_optimal_token_baseline": ("groups", "sum_pi_squared"),
    "gpg": ("groups",),
    "grpo_passk": ("groups",),
    "gdpo": ("groups",),
}
ADV_ESTIMATORS = tuple(ESTIMATOR_NEEDS)
GROUP_ESTIMATORS = tuple(name for name, needs in ESTIMATOR_NEEDS.items() if "groups" in needs)
CRITIC_ESTIMATORS = tuple(name for name, needs in ESTIMATOR_NEEDS.items() if "critic" in needs)
SUM_PI_SQUARED_ESTIMATORS = tuple(name for name, needs in ESTIMATOR_NEEDS.items() if "sum_pi_squared" in needs)
# Estimators with the option algorithm.length_weighted_baseline (dsrl.algorithms.estimator_options).
LENGTH_WEIGHTED_ESTIMATORS = ("rloo", "rloo_vectorized", "reinforce_plus_plus_baseline")
POLICY_LOSS_MODES = (
    "vanilla",
    "gspo",
    "cispo",
    "gpg",
    "dppo_tv",
    "dppo_kl",
    "sapo",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "bypass_mode",
)
# The parameters each built-in policy loss declares (dsrl.algorithms.policy_loss_params), by verl's names: a name is
# read from actor_rollout_ref.actor.policy_loss.<name>, else actor_rollout_ref.actor.<name> (policy_loss_param_key).
POLICY_LOSS_PARAMS = {
    "sapo": ("tau_pos", "tau_neg"),
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
    "dro": ("dro_beta",),
    "bypass_mode": ("rollout_correction",),
}
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_KL_BASE_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# A '+' suffix keeps the value of the base kind and takes the gradient of k2 (unbiased gradient).
KL_KINDS = _KL_BASE_KINDS + tuple(f"{kind}+" for kind in _KL_BASE_KINDS)
# distillation.distillation_loss.loss_mode: verl registers the single-sample estimators (no straight-through "+")
DISTILLATION_LOSS_MODES = _KL_BASE_KINDS
PF_PPO_METHODS = ("pow", "max_min", "max_random")  # dsrl.algorithms.PF_PPO_METHODS
# verl 0.9.1's rollout-correction vocabulary (dsrl.algorithms.ROLLOUT_IS_LEVELS, ROLLOUT_RS_OPTIONS,
# BYPASS_LOSS_TYPES): rollout_is levels, rollout_rs options (comma-separated lists), bypass_mode loss types.
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)  # fmt: skip
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


# ----------------------------------------------------------------------------------------------
# dsrl's own names

REWARD_MANAGERS = ("naive", "dapo")  # verl's reward_model.reward_manager names dsrl has
KL_CTRL_TYPES = ("fixed", "adaptive")
TRUNCATION_MODES = ("error", "left", "right")
ROLLOUT_NAMES = ("hf", "vllm")
SLEEP_LEVELS = (1, 2)
ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")  # verl's actor.router_replay.mode
TRAINER_MODES = ("sync", "colocate_async")  # verl V1's trainer.v1.trainer_mode, but separate_async
OFF_POLICY_STRATEGIES = ("drop", "wait")  # verl V1's trainer.v1.sampler.max_off_policy_strategy
LOGGERS = ("console", "mlflow")
RESUME_MODES = ("auto", "disable", "resume_path")
MEMORY_PLAN_CHECKS = ("error", "warn", "ignore")  # trainer.memory_plan_check
# What a checkpoint holds (verl's checkpoint.save_contents); a ZeRO checkpoint keeps the weights inside the
# optimizer partitions, so model, optimizer and extra (trainer state) are always saved together.
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
REQUIRED_CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")
LR_SCHEDULES = ("constant", "cosine")
MODEL_DTYPES = ("bfloat16", "float32")
PREPARED_TASKS = (
    "gsm8k",
    "math",
    "arithmetic",
    "calculator",
)  # scripts/prepare_data.py --task, and the folder it writes
TOOL_FORMATS = ("hermes",)  # how the model writes a tool call: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
TRUNCATE_SIDES = ("left", "right", "middle")
