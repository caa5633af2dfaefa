"""verl 0.9.1's registered estimators and policy losses called on dsrl's inputs, with the arguments verl's
own trainer would fill in. Shared by the parity tests and ``scripts/bench_estimators.py --against-verl``."""

from __future__ import annotations

import inspect

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig, PolicyLossConfig

from dsrl.algorithms import EstimatorInputs

# Loss parameters verl reads from ActorConfig itself; the others live in ActorConfig.policy_loss.
ACTOR_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg")
ESTIMATORS = core_algos.ADV_ESTIMATOR_REGISTRY
POLICY_LOSSES = core_algos.POLICY_LOSS_REGISTRY


def verl_advantages(name: str, inputs: EstimatorInputs, options: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's estimator ``name`` on ``inputs``; ``options`` are dsrl's ``compute_advantages`` keywords.
    ``index`` is a numpy array of uid strings, as verl's trainer holds it; gdpo's components go in
    ``non_tensor_batch`` in the order of ``inputs.reward_components`` (the order of the weights)."""
    gamma, lam = options.get("gamma", 1.0), options.get("lam", 1.0)
    norm = options.get("norm_adv_by_std", True)
    pool = {
        "token_level_rewards": inputs.token_level_rewards.clone(),
        "response_mask": inputs.response_mask.clone(),
        "index": np.array([f"uid-{int(g)}" for g in inputs.group_ids], dtype=object),
        "config": AlgoConfig(gamma=gamma, lam=lam, norm_adv_by_std_in_grpo=norm, adv_estimator=name),
        "values": inputs.values,
        "gamma": gamma,
        "lam": lam,
        "reward_baselines": inputs.reward_baselines,
        "old_log_probs": inputs.old_log_probs,
        "sum_pi_squared": inputs.sum_pi_squared,
        "rollout_is_weights": inputs.rollout_is_weights,
        "norm_adv_by_std_in_grpo": norm,
        "handle_zero_tail": options.get("handle_zero_tail", True),
    }
    if name == "gdpo":
        keys = list(inputs.reward_components)
        pool["config"] = AlgoConfig(
            norm_adv_by_std_in_grpo=norm,
            adv_estimator=name,
            gdpo_reward_keys=keys,
            gdpo_reward_weights=options.get("gdpo_reward_weights"),
        )
        pool["non_tensor_batch"] = {key: inputs.reward_components[key].numpy() for key in keys}
        prompt = torch.ones(len(inputs.group_ids), 3, dtype=torch.long)
        pool["batch"] = {"prompts": prompt, "attention_mask": torch.cat([prompt, inputs.response_mask.long()], dim=-1)}
    fn = ESTIMATORS[name]
    wanted = inspect.signature(fn).parameters
    return fn(**{key: value for key, value in pool.items() if key in wanted})


def verl_actor_config(params: dict, global_batch_info: dict) -> ActorConfig:
    """verl's ActorConfig carrying the loss parameters ``params`` (verl's names); the batch-size fields only
    satisfy its validation."""
    top = {key: params[key] for key in ACTOR_KEYS if key in params}
    nested = {key: value for key, value in params.items() if key not in ACTOR_KEYS}
    if "rollout_correction" in nested:
        nested["rollout_correction"] = RolloutCorrectionConfig(**nested["rollout_correction"])
    config = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, policy_loss=PolicyLossConfig(**nested), **top
    )
    config.global_batch_info.update(global_batch_info)
    return config


def verl_policy_loss(
    name: str,
    *,
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
    config: ActorConfig,
) -> tuple[torch.Tensor, dict]:
    """verl's policy loss ``name``: ``(loss, metrics as floats)``."""
    return POLICY_LOSSES[name](
        old_log_prob=old_log_probs,
        log_prob=log_probs,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
    )


def assert_close(actual: torch.Tensor | float, expected: torch.Tensor | float, what: str, tol: float) -> None:
    """``actual`` (dsrl's) equals ``expected`` (verl's) within ``tol``, relative and absolute, as float32."""
    actual = torch.as_tensor(actual, dtype=torch.float32)
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: dsrl vs verl\n{m}")
