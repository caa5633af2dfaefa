"""The config sections of the models that judge the policy's responses: the reward model (``reward_model.*``, with
the reward manager that turns scores into rewards) and the distillation teacher (``distillation.*``), verl's keys."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dsrl.config.documented import documented as _f


@dataclass
class OverlongBufferConfig:
    enable: bool = _f(
        False, "add DAPO's soft overlong punishment to each response's score (needs reward_model.reward_manager=dapo)"
    )
    len: int = _f(
        0,
        "the buffer L_cache: responses longer than max_resp_len - len tokens lose up to penalty_factor, linearly; "
        "> 0 and <= max_resp_len (DAPO: 4096 of 20480)",
    )
    penalty_factor: float = _f(
        0.0, "the penalty at max_resp_len tokens; >= 0 (DAPO: 1.0, the score of a correct answer)"
    )
    log: bool = _f(
        False,
        "also return the reward extras overlong_reward (the penalty) and overlong (1 if penalised): "
        "reward/overlong_reward/mean, reward/overlong/mean",
    )


@dataclass
class RewardKwargsConfig:
    max_resp_len: Optional[int] = _f(
        None,
        "dapo: L_max of the overlong punishment, in tokens; null = data.max_response_length (verl requires it set)",
    )
    overlong_buffer_cfg: OverlongBufferConfig = _f(OverlongBufferConfig, "dapo: DAPO's soft overlong punishment")


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = _f(
        None,
        "the reward model: a sequence-classification checkpoint with one label (AutoModelForSequenceClassification, "
        "its head named score): local dir or hub id",
    )
    trust_remote_code: bool = _f(False, "run model code shipped with the checkpoint; only for checkpoints you trust")


@dataclass
class RewardModelConfig:
    enable: bool = _f(
        False,
        "score each response with the reward model at its last token (a frozen ZeRO-3 engine on every rank, like "
        "the reference: its gathered layers freed around generation); without custom_reward_function its score is "
        "the reward (verl's), with one the function gets it as extra_info['reward_model_score']; either way it is the "
        "reward extra reward_model_score (a gdpo_reward_keys component, reward/reward_model_score/mean)",
    )
    model: RewardModelModelConfig = _f(RewardModelModelConfig, "the reward model's checkpoint")
    deepspeed_config: str = _f(
        "zero3_offload_inference", "DeepSpeed setup of the reward model: a name in ds_configs/ or a .json path"
    )
    micro_batch_size_per_gpu: int = _f(8, "sequences per reward-model forward on one rank; memory only")
    max_length: Optional[int] = _f(
        None,
        "longest sequence the reward model reads, in its tokens; null = data.max_prompt_length + max_response_length; "
        "a conversation re-tokenised with the reward model's own chat template that is longer loses its start "
        "(reward_model/truncated_ratio counts them)",
    )
    use_dynamic_bsz: bool = _f(
        "${actor_rollout_ref.actor.use_dynamic_bsz}",
        "split the reward model's forwards by token budget (forward_max_token_len_per_gpu); default: the actor's",
    )
    forward_max_token_len_per_gpu: int = _f(
        "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}",
        "token budget of one reward-model forward when use_dynamic_bsz; default: the actor's training budget",
    )
    reward_manager: str = _f(
        "naive",
        "how a response's score is made: naive (the reward function's score) | dapo (plus, with "
        "reward_kwargs.overlong_buffer_cfg.enable, DAPO's soft overlong punishment, in training and validation)",
    )
    reward_kwargs: RewardKwargsConfig = _f(RewardKwargsConfig, "the reward manager's options (verl's names)")


@dataclass
class DistillationLossConfig:
    loss_mode: str = _f(
        "k3",
        "the per-token divergence of student from teacher on the student's own samples, verl's single-sample "
        "estimators of KL(student || teacher): k1 (= kl: log p_s - log p_t) | k2 (= mse) | k3 (= low_var_kl) | abs",
    )
    use_task_rewards: bool = _f(
        True,
        "keep the policy loss of the task rewards (and its entropy and KL terms) and add distillation_loss_coef x the "
        "distillation loss; false: the distillation loss alone",
    )
    distillation_loss_coef: float = _f(1.0, "weight of the distillation loss beside the task's (use_task_rewards)")
    loss_max_clamp: Optional[float] = _f(
        None, "clamp each token's divergence to [-loss_max_clamp, loss_max_clamp]; null = no clamp"
    )
    use_policy_gradient: bool = _f(
        False,
        "true: the negative divergence is each token's advantage in a clipped policy-gradient loss (on-policy "
        "distillation as a dense reward; use k1); false: the divergence itself is the loss, backpropagated (use k3)",
    )
    policy_loss_mode: str = _f("vanilla", "the policy loss of use_policy_gradient: vanilla (verl has no other)")
    clip_ratio: float = _f(0.2, "use_policy_gradient: PPO clip range where clip_ratio_low/high are null")
    clip_ratio_low: Optional[float] = _f(0.2, "use_policy_gradient: lower clip range; null = clip_ratio")
    clip_ratio_high: Optional[float] = _f(0.2, "use_policy_gradient: upper clip range; null = clip_ratio")


@dataclass
class TeacherModelConfig:
    model_path: Optional[str] = _f(
        None,
        "the teacher: a causal LM with the student's tokenizer (the same token ids), run frozen on every rank as the "
        "reference is (actor_rollout_ref.ref's micro-batch keys): local dir or hub id",
    )
    deepspeed_config: str = _f(
        "zero3_offload_inference", "DeepSpeed setup of the teacher: a name in ds_configs/ or a .json path"
    )


@dataclass
class TeacherModelsConfig:
    teacher_model: TeacherModelConfig = _f(TeacherModelConfig, "the one teacher (dsrl routes no data to others)")


@dataclass
class DistillationConfig:
    enabled: bool = _f(
        False,
        "on-policy distillation: the teacher's log-probs of the student's sampled tokens make a per-token loss "
        "(distillation_loss), alone or beside the task's",
    )
    distillation_loss: DistillationLossConfig = _f(DistillationLossConfig, "how the teacher's log-probs are used")
    teacher_models: TeacherModelsConfig = _f(TeacherModelsConfig, "the teacher model")
